"""Model definitions (the Llama family), their layers, and the architecture registry."""
