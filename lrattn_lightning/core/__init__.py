"""The bottom layer every other may import: one-line errors, the flag style, names, the files we read."""
