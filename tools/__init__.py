"""Command-line tools around training: model conversion, metadata, latent caching, image resizing."""
