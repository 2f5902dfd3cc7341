"""Exit heads: adapters around the model's own final norm and LM head, block adapters, the trimmed draft head, learned
gates (and the one definition of their features), and the saved-heads format."""
