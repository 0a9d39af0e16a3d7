"""Folder -> dataset: scanning, planning, preparing and writing shards, the journal, convert()."""
