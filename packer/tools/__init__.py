"""Commands on finished datasets: info, verify, extract, and the sample-data generator."""
