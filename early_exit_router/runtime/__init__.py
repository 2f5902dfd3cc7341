"""The runtime: patching a model (`router.EarlyExitRouter`), the decode loops (`engine` for one sequence,
`batch_engine` for batches), the routing decisions (`routing`, `policy`, `costs`, `ngram`), the exit heads
(`heads`, saved by `checkpoint`) and token choice (`sampling`)."""
