"""The models: what each architecture looks like (`architecture`: specs and the layer stack; `discovery`: finding
the parts and the self-test), loading the supported models (`loading`, `quantization`), and everything that depends
on the transformers release (`_compat`)."""
