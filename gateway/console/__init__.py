"""The admin web console at ``/admin``: server-rendered pages over the database, htmx for live parts."""
