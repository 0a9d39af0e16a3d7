"""Bytes <-> pixels; knows nothing of datasets: decoders, image headers, the BMP codec, resizing."""
