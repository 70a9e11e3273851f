"""Start one rank of a job whose rank ``--far-rank`` sits behind a rate-limited link (benchmarks/chaos_bandwidth.py).

Usage: ``_netns_rank.py NETNS NEAR_IF FAR_IF FAR_RANK -- COMMAND...``. Every rank uses the near side's address as
MASTER_ADDR (set by the caller); the far rank runs inside the network namespace ``NETNS`` with gloo on ``FAR_IF``,
the others in this namespace with gloo on ``NEAR_IF``. The environment (the probe's bootstrap included) passes
through ``ip netns exec`` unchanged."""

import os
import sys


def main() -> None:
    netns, near_if, far_if, far_rank, sep, *command = sys.argv[1:]
    if sep != "--" or not command:
        raise SystemExit(f"usage: {sys.argv[0]} NETNS NEAR_IF FAR_IF FAR_RANK -- COMMAND...")
    if int(os.environ["RANK"]) == int(far_rank):
        os.environ["GLOO_SOCKET_IFNAME"] = far_if
        os.execvp("ip", ["ip", "netns", "exec", netns, *command])
    os.environ["GLOO_SOCKET_IFNAME"] = near_if
    os.execvp(command[0], command)


if __name__ == "__main__":
    main()
