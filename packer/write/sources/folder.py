"""A loose folder of images: ImageFolder layout (``root/<class>/**/<img>``) or flat; see ``write.scan``."""

from __future__ import annotations

from pathlib import Path

from packer.write.scan import scan_folder
from packer.write.sources.base import FileReader
from packer.write.sources.records import ClassMapper, ScanResult, Source


class FolderSource(Source):
    """Files below a folder, read where they are (``FileReader``), in torchvision ImageFolder's order."""

    type = "folder"

    @classmethod
    def claims(cls, path: Path) -> bool:
        return path.is_dir()

    def scan(self, map_classes: ClassMapper | None = None, *, skip_hidden: bool = False,
             allow_empty: bool = False) -> ScanResult:
        scan = scan_folder(self.path, map_classes=map_classes, skip_hidden=skip_hidden, allow_empty=allow_empty)
        scan.reader = FileReader(scan.root)
        return scan
