"""What an ``oases compare`` table comes to, in lines a user can quote.

* :func:`add_less_contention`: each variant's speed-up with what host contention added taken
  out: its traced iteration replayed without the waits for a CPU
  (:func:`.contention.contention_free_us`, ``trace["contention_free_us"]``), against the
  reference's. Only the traced (last) iteration has the record, so this ratio is of one
  iteration, the raw one of the timed mean.
* :func:`contention`: a run whose variants' contention shares (the share of the traced
  iteration those waits added) differ by more than :data:`CONTENDED_POINTS` percentage points
  met a host whose load changed between its variants; its raw speed-ups mix that in, and one
  line says to rerun it on a quieter host.
* :func:`best_against_best`: the fastest stock variant against the fastest Oases variant, and
  where the memory pass measured peak memory, the same at each lower peak-memory level where the
  pair changes (what a GPU of that memory would run); a stock recompute setting that ran without
  its Oases twin (:func:`.variants.twins`) is named, since then the pair is not like against like.
"""

from .memory import GB, is_stock
from .variants import missing_twins

#: Contention shares (percentage points of the traced iteration) the variants may differ by
#: before the run is marked contended.
CONTENDED_POINTS = 5.0


def run_queue_share(result):
    """The share of a finished variant's traced iteration its compute threads waited for a CPU
    (``runq_us``, mean over ranks); None without a trace or a run-queue record (not Linux)."""
    t = result.get("trace") or {}
    if result.get("status") != "ok" or t.get("runq_us") is None or not t.get("iteration_us"):
        return None
    return t["runq_us"] / t["iteration_us"]


def contention_share(result):
    """The share of a finished variant's traced iteration that waiting for a CPU added (1 − the
    replayed iteration ÷ the traced one); None without the replay."""
    t = result.get("trace") or {}
    if result.get("status") != "ok" or t.get("contention_free_us") is None:
        return None
    return max(0.0, 1 - t["contention_free_us"] / t["iteration_us"])


def add_less_contention(results, ref):
    """In place, per variant: ``run_queue_share``, ``contention_share``,
    ``iteration_less_contention_s`` (the traced iteration replayed without contention) and
    ``speedup_less_contention`` (the reference's over it, as ``speedup`` is of the timed means);
    None where the trace has no replay."""

    def less(r):
        free = (r.get("trace") or {}).get("contention_free_us")
        return None if contention_share(r) is None else free / 1e6

    base = less(ref) if ref is not None else None
    for r in results:
        r["run_queue_share"] = run_queue_share(r)
        r["contention_share"] = contention_share(r)
        r["iteration_less_contention_s"] = mine = less(r)
        r["speedup_less_contention"] = base / mine if base and mine else None


def contention(results):
    """``{shares, spread_points, contended, line}`` of the variants' contention shares (after
    :func:`add_less_contention`); ``line`` is None unless ``contended``. None with fewer than two
    shares."""
    shares = {
        r["name"]: r["contention_share"] for r in results if r.get("contention_share") is not None
    }
    if len(shares) < 2:
        return None
    low, high = min(shares, key=shares.get), max(shares, key=shares.get)
    spread = 100 * (shares[high] - shares[low])
    contended = spread > CONTENDED_POINTS
    line = None
    if contended:
        line = (
            f"contended: waiting for a CPU added {100 * shares[low]:.1f} % ({low}) to "
            f"{100 * shares[high]:.1f} % ({high}) to the variants' traced iterations, "
            f"{spread:.1f} points apart (more than {CONTENDED_POINTS:g}): the host's load changed "
            "between them and moved the raw speed-ups; read the speed-ups less contention, or "
            "rerun on a quieter host"
        )
    return {"shares": shares, "spread_points": spread, "contended": contended, "line": line}


def _peak(r):
    return (r.get("memory") or {}).get("peak_bytes_per_rank")


def _fastest(rows, stock):
    side = [r for r in rows if is_stock(r) == stock]
    return min(side, key=lambda r: r["mean_iteration_s"]) if side else None


def _level(limit, stock, oases):
    def part(r):
        return r and {"name": r["name"], "s_per_iter": r["mean_iteration_s"], "peak_gb": _gb(r)}

    return {
        "limit_gb": limit,
        "stock": part(stock),
        "oases": part(oases),
        "speedup": (
            stock["mean_iteration_s"] / oases["mean_iteration_s"] if stock and oases else None
        ),
    }


def _gb(r):
    peak = _peak(r)
    return None if peak is None else peak / GB


def best_against_best(results, corrected=False):
    """``{levels, missing_twins, line}``: the fastest stock and the fastest Oases variant that ran
    (``levels[0]``, ``limit_gb`` None), then per peak-memory level the memory pass measured, from
    the highest down, the fastest of each side whose peak per rank fits, wherever that pair
    changes (``limit_gb``: the larger of the pair's peaks, the least memory that runs it); None
    where no variant ran. ``corrected``: the line also gives the speed-ups less contention (a
    contended run)."""
    ok = [r for r in results if r.get("status") == "ok" and r.get("mean_iteration_s")]
    if not ok:
        return None
    levels = [_level(None, _fastest(ok, True), _fastest(ok, False))]
    measured = [r for r in ok if _peak(r) is not None]
    last = None
    for limit in sorted({_peak(r) for r in measured}, reverse=True):
        fit = [r for r in measured if _peak(r) <= limit]
        stock, oases = _fastest(fit, True), _fastest(fit, False)
        names = (stock and stock["name"], oases and oases["name"])
        if names == last:
            continue
        last = names
        top = max(_peak(r) for r in (stock, oases) if r is not None) / GB
        if limit == max(_peak(r) for r in measured) and _same(levels[0], names):
            continue  # everything fits: the overall pair again
        levels.append(_level(top, stock, oases))
    twins = missing_twins([r["name"] for r in ok])
    by_name = {r["name"]: r for r in ok}
    return {
        "levels": levels,
        "missing_twins": twins,
        "line": _line(levels, twins, bool(measured), by_name if corrected else None),
    }


def _same(level, names):
    return tuple((level[s] or {}).get("name") for s in ("stock", "oases")) == names


def _side(p, ratio=None, corrected=None):
    if p is None:
        return None
    extra = ""
    if ratio is not None:
        extra = f" ({ratio:.2f}x" + (
            f"; {corrected:.2f}x less contention)" if corrected is not None else ")"
        )
    where = "" if p["peak_gb"] is None else f" at {p['peak_gb']:.3g} GB"
    return f"{p['name']} {p['s_per_iter']:.4g} s/iter{extra}{where}"


def _less_contention(level, by_name):
    if by_name is None or not level["stock"] or not level["oases"]:
        return None
    s, o = (
        by_name[level[k]["name"]].get("iteration_less_contention_s") for k in ("stock", "oases")
    )
    return s / o if s and o else None


def _line(levels, twins, measured, by_name):
    """The levels as one line (host seconds per iteration, GB per rank)."""
    parts = []
    for k, level in enumerate(levels):
        stock = _side(level["stock"])
        oases = _side(level["oases"], level["speedup"], _less_contention(level, by_name))
        if k == 0:
            parts.append(f"best stock: {stock or 'none ran'}")
            parts.append(f"best Oases: {oases or 'none ran'}")
            continue
        parts.append(
            f"at <= {level['limit_gb']:.3g} GB: {stock or 'no stock variant fits'} vs "
            f"{oases or 'no Oases variant fits'}"
        )
    if not measured:
        parts.append("peak memory not measured (--memory-budget measures it)")
    parts += [f"no Oases twin of {s} ran (add {t} to --variants)" for s, t in twins]
    return "; ".join(parts)
