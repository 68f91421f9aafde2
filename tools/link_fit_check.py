#!/usr/bin/env python3
"""How well a link's round trip predicts the job's transfers over it.

Reads `detourctl links --json` snapshots of running jobs and takes, from each,
the links whose bandwidth was fitted to the job's own transfers (source
SOURCE_TRAFFIC). A link's time on the wire per byte is 1 / its fitted rate,
its round trip twice its one-way latency. Three models predict the wire time
from the round trip, as the coordinator plans a link no transfer crossed:

  median   wire = m * rtt       m: the median of wire / rtt (the coordinator's)
  line     wire = c + k * rtt   Theil-Sen (median of pairwise slopes), c, k >= 0
  lsq      wire = c + k * rtt   least squares, c, k >= 0

Each is judged twice: leave-one-out over the fitted links, and fitted on the
shortest two thirds by round trip, then judged on the longest third (the links
a refit has not fitted are the longest). Errors are the median factor
between prediction and fit, less one (0.5: off by 1.5x); bias is the median
log ratio of prediction to fit on the longest third (negative: predicted
faster than the transfers ran). Exits 0, or 2 for a file it cannot read.

  tools/link_fit_check.py LINKS.json [LINKS.json ...]
"""
import argparse
import json
import math
import statistics
import sys


def points(snapshot):
    """(round trip s, wire s per byte) of the links fitted to transfers."""
    out = []
    for link in snapshot.get('links', []):
        if link.get('bandwidth_source') != 'SOURCE_TRAFFIC':
            continue
        latency = link.get('latency_seconds', 0)
        rate = link.get('bandwidth_bytes_per_s', 0)
        if latency > 0 and rate > 0:
            out.append((2 * latency, 1 / rate))
    return sorted(out)


def median_model(pts):
    m = statistics.median(y / x for x, y in pts)
    return lambda x: m * x


def theil_sen(pts):
    slopes = [(y2 - y1) / (x2 - x1) for i, (x1, y1) in enumerate(pts)
              for x2, y2 in pts[i + 1:] if x2 - x1 > 1e-9]
    k = max(0.0, statistics.median(slopes)) if slopes else 0.0
    c = statistics.median(y - k * x for x, y in pts)
    if c < 0:  # through the origin: the median model
        return median_model(pts)
    return lambda x: c + k * x


def least_squares(pts):
    n = len(pts)
    mx = sum(x for x, _ in pts) / n
    my = sum(y for _, y in pts) / n
    sxx = sum((x - mx) ** 2 for x, _ in pts)
    k = max(0.0, sum((x - mx) * (y - my) for x, y in pts) / sxx) if sxx > 0 else 0.0
    c = my - k * mx
    if c < 0:
        k = sum(x * y for x, y in pts) / sum(x * x for x, _ in pts)
        c = 0.0
    return lambda x: c + k * x


MODELS = {'median': median_model, 'line': theil_sen, 'lsq': least_squares}


def judge(pts):
    """Per model: leave-one-out error, longest-third error and bias."""
    out = {}
    cut = len(pts) * 2 // 3
    shorter, longer = pts[:cut], pts[cut:]
    for name, fit in MODELS.items():
        loo = []
        for i, (x, y) in enumerate(pts):
            model = fit(pts[:i] + pts[i + 1:])
            loo.append(abs(math.log(model(x) / y)))
        model = fit(shorter)
        logs = [math.log(model(x) / y) for x, y in longer]
        out[name] = (math.exp(statistics.median(loo)) - 1,
                     math.exp(statistics.median(abs(v) for v in logs)) - 1,
                     statistics.median(logs))
    return out


def main():
    parser = argparse.ArgumentParser(
        description=__doc__.split('\n\n')[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog='\n\n'.join(__doc__.split('\n\n')[1:]))
    parser.add_argument('files', nargs='+', metavar='LINKS.json',
                        help='output of detourctl links --json')
    args = parser.parse_args()
    print('%-28s %5s %13s  %-24s %-24s %-24s' %
          ('snapshot', 'links', 'rtt s', 'median loo/long/bias', 'line loo/long/bias',
           'lsq loo/long/bias'))
    for path in args.files:
        try:
            with open(path) as f:
                snapshot = json.load(f)
        except (OSError, ValueError) as e:
            print(f'{path}: {e}', file=sys.stderr)
            return 2
        pts = points(snapshot)
        if len(pts) < 6:
            print('%-28s %5d  too few links fitted to transfers (6 needed)' % (path, len(pts)))
            continue
        j = judge(pts)
        cells = ['%.2f / %.2f / %+.2f' % j[name] for name in MODELS]
        print('%-28s %5d %6.3f-%6.3f  %-24s %-24s %-24s' %
              (path[-28:], len(pts), pts[0][0], pts[-1][0], *cells))
    return 0


if __name__ == '__main__':
    sys.exit(main())
