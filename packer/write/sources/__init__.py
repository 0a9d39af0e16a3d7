"""Sources: what ``convert`` reads from. One module per kind of input, each giving the same records.

``base.py`` holds the interface (``Source``, ``SourceReader``, ``SourceOptions``, ``RecordError``);
``registry.py`` chooses a source by what SRC is (``open_source``); ``select.py`` keeps a subset of
classes and splits records (``--classes``, ``--split``), whatever the source. See docs/sources.md.
"""
