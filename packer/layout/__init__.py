"""The on-disk contract shared by writing and reading: manifest, per-sample metadata, checks of untrusted input."""
