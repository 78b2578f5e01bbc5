"""User-facing input errors. Their messages name the file, line and field; stages print them
as one line and exit 2, leaving everything already stored untouched."""


class InputError(ValueError):
    """Bad user input: params, data files or model paths."""
