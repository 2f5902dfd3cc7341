"""The tools behind the command line: training and evaluating heads (`training`, `corpus`, `head_report`,
`survey`), calibration, the benchmarks (`bench`, `batch_bench`, `metrics`, `compute`), `export`, `memory` and
`trace`."""
