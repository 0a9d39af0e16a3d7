"""Object storage: locations (url), one store interface over S3, GCS, Azure, HTTP and local files (store, with
client: one connection per process, and faults: timeouts, retries, errors), a node-wide range cache (cache), many
ranged reads in flight (fetch) and an emulated slow store (emulate). docs/remote.md has the API and the figures.

Below ``layout/`` so that reading a manifest can use it; it imports only layer 0 (errors, units, perprocess).
"""
