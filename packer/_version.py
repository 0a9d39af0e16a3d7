"""The version of packer, in one place (read by packer/__init__.py and the build)."""

__version__ = "0.1.0"
DISTRIBUTION = "packer-images"  # what `pip install` takes: "packer" on the index is another project
