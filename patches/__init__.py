"""Architecture spec overrides for early-exit-router, as data: `<family>.json` files read by
`early_exit_router.architecture`, installed as `early_exit_router.patches`.

Every supported family is discovered from its module tree and config and checked numerically on each patch
(`early_exit_router/discovery.py`), so no family needs a file here today. A file is for what discovery cannot infer:
its keys are the fields of `ArchitectureSpec`, and the self-test still runs on it.
"""
