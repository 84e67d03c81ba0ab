"""Put the peers' test sources where ``scripts/peer_suites.py`` reads them, outside this repository.

Nothing is downloaded: TRL comes from a local git mirror (a bare repository, e.g. the one the session's ``fetch``
tool leaves in ``/work/.mirror/huggingface+trl/repo``), transformers' Trainer test files from a folder you provide
(transformers' repository is too large to mirror here; docs/testing.md says how the files were obtained). Each
destination gets a ``PEER_SOURCE.txt`` whose first line the runner prints as the tests' origin.

Usage::

    python scripts/peer_suites/peer_suites_sources.py trl --mirror /work/.mirror/huggingface+trl/repo \
        --dest /work/peer-src/trl
    python scripts/peer_suites/peer_suites_sources.py transformers --from ~/tf-trainer-tests \
        --dest /work/peer-src/transformers
"""

from __future__ import annotations

import argparse
import hashlib
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

#: transformers files the runner uses: name -> place in the checkout layout
TRANSFORMERS_FILES = {
    "test_trainer.py": "tests/trainer/test_trainer.py",
    "trainer_test_utils.py": "tests/trainer/trainer_test_utils.py",
    "test_trainer_moe_loss.py": "tests/trainer/test_trainer_moe_loss.py",
    "sample_text.txt": "tests/fixtures/sample_text.txt",
}


def extract_trl(mirror: Path, dest: Path, ref: str) -> str:
    """``git archive`` of ``ref`` into ``dest`` (a fresh folder); returns the origin line."""
    git = ["git", "--git-dir", str(mirror)]
    commit = subprocess.run(git + ["rev-parse", ref], check=True, capture_output=True, text=True).stdout.strip()
    date = subprocess.run(git + ["log", "-1", "--format=%cd", "--date=short", commit], check=True,
                          capture_output=True, text=True).stdout.strip()
    if dest.exists():
        shutil.rmtree(dest)
    dest.mkdir(parents=True)
    with tempfile.TemporaryFile() as archive:
        subprocess.run(git + ["archive", "--format=tar", commit], check=True, stdout=archive)
        archive.seek(0)
        with tarfile.open(fileobj=archive) as tar:
            tar.extractall(dest, filter="data")
    version = (dest / "VERSION").read_text().strip() if (dest / "VERSION").exists() else "?"
    return f"huggingface/trl {commit} ({date}, VERSION {version})"


def place_transformers(source: Path, dest: Path) -> str:
    """Copy the known transformers test files (found anywhere under ``source``) into the checkout layout."""
    lines = []
    for name, rel in TRANSFORMERS_FILES.items():
        found = sorted(source.rglob(name))
        if not found:
            lines.append(f"{rel}: missing")
            continue
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(found[0], target)
        lines.append(f"{rel}: sha256 {hashlib.sha256(target.read_bytes()).hexdigest()}")
    for package in ("tests", "tests/trainer"):
        (dest / package / "__init__.py").touch()
    return "huggingface/transformers tests/trainer files provided by hand (see docs/testing.md)\n" + "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="peer", required=True)
    trl = sub.add_parser("trl", help="extract a TRL checkout from a bare git mirror")
    trl.add_argument("--mirror", type=Path, required=True)
    trl.add_argument("--ref", default="HEAD")
    trl.add_argument("--dest", type=Path, required=True)
    tf = sub.add_parser("transformers", help="lay out transformers' Trainer test files given in a folder")
    tf.add_argument("--from", dest="source", type=Path, required=True)
    tf.add_argument("--dest", type=Path, required=True)
    args = parser.parse_args(argv)
    if args.peer == "trl":
        origin = extract_trl(args.mirror, args.dest, args.ref)
    else:
        args.dest.mkdir(parents=True, exist_ok=True)
        origin = place_transformers(args.source, args.dest)
    (args.dest / "PEER_SOURCE.txt").write_text(origin + "\n")
    print(origin)


if __name__ == "__main__":
    main()
