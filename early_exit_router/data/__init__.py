"""Data shipped with the package: the training prompt set for self-distillation."""
