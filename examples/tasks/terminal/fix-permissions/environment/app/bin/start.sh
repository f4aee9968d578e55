#!/bin/bash
# Start the app server.
exec python3 -m http.server --directory /srv/app/public 8000
