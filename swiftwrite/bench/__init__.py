"""`swiftwrite bench`: every decoding method side by side on one loaded model, with the text's quality beside each
speed (built on run/'s assembly)."""
