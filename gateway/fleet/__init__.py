"""The distributed mode: gateways schedule episode jobs over Celery + Redis onto worker nodes."""
