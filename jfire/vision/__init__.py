"""Image input: preprocessing, vision towers and projectors that turn pixels into text-width embeddings."""
