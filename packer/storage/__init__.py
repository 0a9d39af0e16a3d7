"""Object storage: locations (url), one client interface over S3, GCS, Azure, HTTP and local files (store), a
node-wide range cache (cache), many ranged reads in flight (fetch) and an emulated slow store (emulate).

Below ``layout/`` so that reading a manifest can use it; it imports only layer 0 (errors, units, perprocess).
"""
