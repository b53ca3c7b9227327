#!/usr/bin/env python3
"""Writes a generated MNIST-shaped image set in IDX format: 28x28 grey images of the ten digit
glyphs of Pillow's built-in font, each drawn at a random size, position, rotation, shear and
stroke width, with pixel noise, so that `starling train --model mlp --data DIR` has a task of
MNIST's size and shape without downloading anything (this machine reaches only package
registries). Deterministic for a given --seed.

    python3 scripts/make_idx_glyphs.py OUT_DIR [--train 60000] [--test 10000] [--seed 1]

Needs numpy and pillow (pip install numpy pillow). Writes train-images-idx3-ubyte,
train-labels-idx1-ubyte, t10k-images-idx3-ubyte and t10k-labels-idx1-ubyte.
"""
import argparse
import os
import struct

import numpy as np
from PIL import Image, ImageDraw, ImageFont

SIZE = 28


def glyph(rng, digit, font_sizes):
    big = 56
    img = Image.new("L", (big, big), 0)
    draw = ImageDraw.Draw(img)
    size = int(rng.choice(font_sizes))
    font = ImageFont.load_default(size=size)
    stroke = int(rng.integers(0, 3))
    x = big / 2 + rng.normal(0, 3)
    y = big / 2 + rng.normal(0, 3)
    draw.text((x, y), str(digit), fill=255, font=font, anchor="mm", stroke_width=stroke, stroke_fill=255)
    angle = rng.normal(0, 12)
    shear = rng.normal(0, 0.15)
    img = img.rotate(angle, resample=Image.BILINEAR)
    img = img.transform(img.size, Image.AFFINE, (1, shear, -shear * big / 2, 0, 1, 0), resample=Image.BILINEAR)
    img = img.resize((SIZE, SIZE), resample=Image.BILINEAR)
    a = np.asarray(img, dtype=np.float32)
    a += rng.normal(0, 18, a.shape)
    return np.clip(a, 0, 255).astype(np.uint8)


def write_idx(path, array, kind):
    with open(path, "wb") as f:
        if kind == "images":
            n, rows, cols = array.shape
            f.write(struct.pack(">IIII", 0x00000803, n, rows, cols))
        else:
            f.write(struct.pack(">II", 0x00000801, array.shape[0]))
        f.write(array.tobytes())


def make(rng, n):
    labels = rng.integers(0, 10, n).astype(np.uint8)
    font_sizes = np.arange(22, 44)
    images = np.stack([glyph(rng, int(d), font_sizes) for d in labels])
    return images, labels


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out")
    p.add_argument("--train", type=int, default=60000)
    p.add_argument("--test", type=int, default=10000)
    p.add_argument("--seed", type=int, default=1)
    a = p.parse_args()
    os.makedirs(a.out, exist_ok=True)
    rng = np.random.default_rng(a.seed)
    for prefix, n in (("train", a.train), ("t10k", a.test)):
        images, labels = make(rng, n)
        write_idx(os.path.join(a.out, f"{prefix}-images-idx3-ubyte"), images, "images")
        write_idx(os.path.join(a.out, f"{prefix}-labels-idx1-ubyte"), labels, "labels")
        print(f"{prefix}: {n} images")


if __name__ == "__main__":
    main()
