"""The four mechanisms, one file each, importing only torch: copy one out and it works."""
