"""The one exception type packer raises for bad input, bad datasets and refused operations."""


class PackerError(Exception):
    """A problem packer found and explains: the message names the file and the reason."""


class ResumableError(PackerError):
    """A conversion failed mid-way (a full disk, an I/O error); its work is kept for ``--resume``.

    The CLI exits with 1 for it (the problem was met while working), 2 for other PackerErrors
    (refused up front).
    """
