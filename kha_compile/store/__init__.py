"""Storage: the KHA checkpoint format, transformers' config and weight files, and key names."""
