"""Where the router meets other software: `model.generate()` (`hf_generate`) and the OpenAI-compatible server
(`server`)."""
