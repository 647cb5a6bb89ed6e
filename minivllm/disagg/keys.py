"""``python -m minivllm.disagg.keys DIR [--decode N]``: CURVE keypairs for ``ZmqPullConnector``'s
side channel (``minivllm/distributed/kv_transfer/zmq_pull_curve.py``), written with
``zmq.auth.create_certificates``:

    DIR/prefill.key, DIR/prefill.key_secret       the side channel's keypair, shared by every P
    DIR/decode{i}.key, DIR/decode{i}.key_secret   one keypair per decode instance
    DIR/allowed/decode{i}.key                      the public keys P accepts

Secret files are readable by their owner only. It prints, one JSON line per instance, the
``kv_connector_extra_config`` entries to give it; copy only ``*.key_secret`` files of that
instance to its machine, and the public ``*.key`` files where they are named.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
from typing import Optional


def make_keys(folder: str, num_decode: int = 1) -> dict[str, dict[str, str]]:
    """Write the keypairs; return each instance's CURVE entries of ``kv_connector_extra_config``
    (``"prefill"`` for every P, ``"decode{i}"``)."""
    import zmq.auth
    os.makedirs(folder, mode=0o700, exist_ok=True)
    allowed = os.path.join(folder, "allowed")
    os.makedirs(allowed, mode=0o700, exist_ok=True)
    names = ["prefill"] + [f"decode{i}" for i in range(num_decode)]
    files = {}
    for name in names:
        public, secret = zmq.auth.create_certificates(folder, name)
        os.chmod(secret, 0o600)
        files[name] = (public, secret)
        if name != "prefill":
            shutil.copy(public, os.path.join(allowed, os.path.basename(public)))
    configs = {"prefill": {"curve_secret_key_file": files["prefill"][1],
                           "curve_public_key_file": files["prefill"][0],
                           "curve_allowed_clients_dir": allowed}}
    for name in names[1:]:
        configs[name] = {"curve_secret_key_file": files[name][1],
                         "curve_public_key_file": files[name][0],
                         "curve_server_public_key_file": files["prefill"][0]}
    return configs


def main(argv: Optional[list[str]] = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m minivllm.disagg.keys", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("dir", help="where to write the keys (made if missing)")
    ap.add_argument("--decode", type=int, default=1, help="how many decode keypairs")
    args = ap.parse_args(argv)
    if args.decode < 1:
        ap.error("--decode must be >= 1")
    for name, extra in make_keys(args.dir, args.decode).items():
        print(json.dumps({"instance": name, "kv_connector_extra_config": extra}))


if __name__ == "__main__":
    main()
