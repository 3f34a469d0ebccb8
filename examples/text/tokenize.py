"""Byte-level tokenisation of a real English text for the language-model example.

The text is the `fortunes` Debian package's collection (quotations, definitions, jokes and
sayings; about 2.3 MB of plain English, in /usr/share/games/fortunes): every plain-text
file of it, in name order, each fortune ending with a newline. Token ids are the bytes
(a vocabulary of 256), written as little-endian u16 (what `train --tokens u16` reads);
the last VAL_FRACTION of the fortunes is held out as the validation set.

Usage: python3 tokenize.py OUT_DIR [FORTUNES_DIR]
Writes OUT_DIR/train.bin and OUT_DIR/val.bin and prints their sizes.
"""
import os
import sys

VAL_FRACTION = 0.05


def fortunes(folder):
    # The plain files: not the `.dat` indexes, not the `.u8` links to the same files.
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith((".dat", ".u8")) or os.path.islink(path) or not os.path.isfile(path):
            continue
        with open(path, "rb") as f:
            for fortune in f.read().split(b"\n%\n"):
                fortune = fortune.strip(b"\n%")
                if fortune:
                    yield fortune + b"\n"


def write_u16(path, data):
    # Bytes as little-endian u16 ids: each byte followed by a zero byte.
    out = bytearray(2 * len(data))
    out[0::2] = data
    with open(path, "wb") as f:
        f.write(out)


def main():
    out_dir = sys.argv[1]
    folder = sys.argv[2] if len(sys.argv) > 2 else "/usr/share/games/fortunes"
    if not os.path.isdir(folder):
        sys.exit(f"{folder}: no fortunes; install the Debian package `fortunes` (apt-get install fortunes)")
    items = list(fortunes(folder))
    cut = int(len(items) * (1 - VAL_FRACTION))
    os.makedirs(out_dir, exist_ok=True)
    for name, part in (("train.bin", items[:cut]), ("val.bin", items[cut:])):
        data = b"".join(part)
        write_u16(os.path.join(out_dir, name), data)
        print(f"{name}: {len(part)} fortunes, {len(data)} tokens")


if __name__ == "__main__":
    main()
