"""The one exception type packer raises for bad input, bad datasets and refused operations."""


class PackerError(Exception):
    """A problem packer found and explains: the message names the file and the reason."""
