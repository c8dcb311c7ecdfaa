"""Container healthcheck: the service's Prometheus endpoint answers (`SAO_METRICS_PORT`); a service
run without one (port 0) is healthy while its process runs, which is all Docker can then see."""

import os
import sys
import urllib.request

port = os.environ.get("SAO_METRICS_PORT", "0")
if port != "0":
    try:
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).close()
    except OSError as e:
        sys.exit(f"metrics on port {port}: {e}")
