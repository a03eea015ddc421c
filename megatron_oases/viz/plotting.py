"""matplotlib for the package's PNGs (timelines, ``oases compare``'s summary and memory plots)."""


def pyplot():
    """``matplotlib.pyplot`` on the non-interactive Agg backend (files only, no display needed)."""
    try:
        import matplotlib
    except ImportError as exc:  # pragma: no cover - matplotlib is a declared dependency
        raise RuntimeError("timelines need matplotlib: pip install matplotlib") from exc
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt
