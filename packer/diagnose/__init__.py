"""Measuring, then explaining: bench, doctor, profile; nothing in write/, read/ or tools/ imports it."""
