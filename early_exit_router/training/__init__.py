"""Training and evaluating exit heads: hidden-state caches, distillation, gates, the corpus, head reports, the exit
survey and calibration."""
