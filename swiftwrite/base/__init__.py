"""Foundations every layer stands on, with no torch in them: the errors a user sees, where files live, files that
survive a kill, the one reader of the user's files, the machine's kept measurements, the table of options and the
validated configuration built from it, a model's shape, the text-quality measures."""
