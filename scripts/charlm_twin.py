#!/usr/bin/env python3
"""A PyTorch twin of Starling's built-in `charlm` (cli/src/train/model.rs), to compare learning
curves with `starling train --model charlm`.

What it reproduces, bit for bit where the maths allows:
  * the text: vocabulary = the text's distinct characters in code-point order (Rust's
    BTreeSet<char>), the last tenth (len // 10 characters) is the validation part
    (cli/src/train/data.rs read_text);
  * the initial parameters: tensors in name order, filled from rand 0.8's
    StdRng::seed_from_u64(seed) (ChaCha12, ported below) with Starling's init_rule and
    training/src/params/init.rs (layer norms 1/0, embeddings N(0, 0.02) by Box-Muller,
    biases 0, linear weights U(-1/sqrt(fan_in), 1/sqrt(fan_in)) in f32 with the clamp below high);
  * the batches: Sampler, window starts gen_range(0..len(train) - context) from
    StdRng::seed_from_u64(sample_seed), rand 0.8's widening-multiply rejection;
    (`starling train` seeds its sampler from the peer id, see cli/src/train/mod.rs seed_of, so
    pass --sample-seed to match a known peer);
  * the model: pre-norm blocks (ln1, qkv, causal mask with -1e9 added, softmax, proj, ln2,
    fc 4*dim, tanh-GELU, out), ln_f, head; layer-norm eps 1e-5; mean cross-entropy;
  * AdamW: torch.optim.AdamW (betas 0.9/0.999, eps 1e-8, decoupled decay), which is the update
    training/src/optim/adamw.rs documents; constant learning rate (no schedule in starling train);
  * evaluation: up to 64 non-overlapping validation windows starting at 0, in chunks of 16,
    mean of the chunks' mean losses weighted by windows.

Modes:
  charlm_twin.py --write-text PATH --sentences N
  charlm_twin.py --text PATH [--dim 128 --layers 3 --heads 4 --context 64 --batch-size 32
                  --lr 0.003 --steps 400 --eval-at 50,100,200,300,400 --seed S] [--detach-norms]
  charlm_twin.py --self-test      (checks the RNG port against rand's published values)
"""

import argparse
import json
import math
import sys
import time

import numpy as np

MASK64 = (1 << 64) - 1


# ----------------------------------------------------------------------------------------------
# rand 0.8 StdRng (= rand_chacha 0.3 ChaCha12Rng), seed_from_u64 from rand_core 0.6.
# ----------------------------------------------------------------------------------------------

def _rotl(x, n):
    return (x << np.uint32(n)) | (x >> np.uint32(32 - n))


def chacha_blocks(key_words, first_block, nblocks, rounds=12):
    """ChaCha keystream blocks `first_block ..` (64-bit counter in words 12-13, nonce 0) as a
    flat array of u32 words, block after block."""
    ctr = np.arange(first_block, first_block + nblocks, dtype=np.uint64)
    init = np.zeros((16, nblocks), dtype=np.uint32)
    init[0:4] = np.array([0x61707865, 0x3320646E, 0x79622D32, 0x6B206574], dtype=np.uint32)[:, None]
    init[4:12] = np.asarray(key_words, dtype=np.uint32)[:, None]
    init[12] = (ctr & np.uint64(0xFFFFFFFF)).astype(np.uint32)
    init[13] = (ctr >> np.uint64(32)).astype(np.uint32)
    x = [init[i].copy() for i in range(16)]

    def qr(a, b, c, d):
        x[a] += x[b]; x[d] ^= x[a]; x[d] = _rotl(x[d], 16)
        x[c] += x[d]; x[b] ^= x[c]; x[b] = _rotl(x[b], 12)
        x[a] += x[b]; x[d] ^= x[a]; x[d] = _rotl(x[d], 8)
        x[c] += x[d]; x[b] ^= x[c]; x[b] = _rotl(x[b], 7)

    with np.errstate(over="ignore"):
        for _ in range(rounds // 2):
            qr(0, 4, 8, 12); qr(1, 5, 9, 13); qr(2, 6, 10, 14); qr(3, 7, 11, 15)
            qr(0, 5, 10, 15); qr(1, 6, 11, 12); qr(2, 7, 8, 13); qr(3, 4, 9, 14)
        out = np.stack(x) + init
    return out.T.reshape(-1)


class StdRng:
    """rand 0.8's StdRng. Its BlockRng hands out the keystream's u32 words in order; next_u64
    is two consecutive words, low first (also across a buffer refill), so the whole generator
    is a cursor over the keystream."""

    CHUNK_BLOCKS = 4096

    def __init__(self, key_words, rounds=12):
        self.key = np.asarray(key_words, dtype=np.uint32)
        self.rounds = rounds
        self.buf = np.zeros(0, dtype=np.uint32)
        self.pos = 0
        self.next_block = 0

    @classmethod
    def from_seed(cls, seed32, rounds=12):
        return cls(np.frombuffer(bytes(seed32), dtype="<u4"), rounds)

    @classmethod
    def seed_from_u64(cls, state):
        mul, inc = 6364136223846793005, 11634580027462260723
        words = []
        for _ in range(8):
            state = (state * mul + inc) & MASK64
            xorshifted = (((state >> 18) ^ state) >> 27) & 0xFFFFFFFF
            rot = state >> 59
            words.append(((xorshifted >> rot) | (xorshifted << (32 - rot))) & 0xFFFFFFFF)
        return cls(words)

    def u32s(self, n):
        """The next `n` words as next_u32 would return them."""
        while len(self.buf) - self.pos < n:
            blocks = max(self.CHUNK_BLOCKS, (n - (len(self.buf) - self.pos)) // 16 + 1)
            new = chacha_blocks(self.key, self.next_block, blocks, self.rounds)
            self.next_block += blocks
            self.buf = np.concatenate([self.buf[self.pos:], new])
            self.pos = 0
        out = self.buf[self.pos:self.pos + n]
        self.pos += n
        return out

    def u64s(self, n):
        w = self.u32s(2 * n).astype(np.uint64)
        return w[0::2] | (w[1::2] << np.uint64(32))

    def next_u64(self):
        return int(self.u64s(1)[0])

    def f32s(self, n):
        """rng.gen::<f32>(): the top 24 bits of a u32, times 2^-24."""
        return (self.u32s(n) >> np.uint32(8)).astype(np.float32) * np.float32(1.0 / (1 << 24))

    def f64s(self, n):
        """rng.gen::<f64>(): the top 53 bits of a u64, times 2^-53."""
        return (self.u64s(n) >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))

    def gen_range(self, low, high):
        """rng.gen_range(low..high) for usize (rand 0.8 UniformInt::sample_single)."""
        rng = (high - 1 - low + 1) & MASK64
        lz = 64 - rng.bit_length()
        zone = ((rng << lz) & MASK64) - 1
        while True:
            m = self.next_u64() * rng
            if (m & MASK64) <= zone:
                return low + (m >> 64)


def self_test():
    # rand_chacha 0.3 test_chacha_true_values_a (ChaCha20, zero seed): first two blocks.
    r = StdRng.from_seed(bytes(32), rounds=20)
    got = [int(v) for v in r.u32s(32)]
    want = [0xade0b876, 0x903df1a0, 0xe56a5d40, 0x28bd8653, 0xb819d2bd, 0x1aed8da0, 0xccef36a8,
            0xc70d778b, 0x7c5941da, 0x8d485751, 0x3fe02477, 0x374ad8b8, 0xf4b8436a, 0x1ca11815,
            0x69b687c3, 0x8665eeb2,
            0xbee7079f, 0x7a385155, 0x7c97ba98, 0x0d082d73, 0xa0290fcb, 0x6965e348, 0x3e53c612,
            0xed7aee32, 0x7621b729, 0x434ee69c, 0xb03371d5, 0xd539d874, 0x281fed31, 0x45fb0a51,
            0x1f0ae1ac, 0x6f4d794b]
    assert got == want, "ChaCha20 test vector"
    # rand 0.8 test_stdrng_construction: StdRng::from_seed, then StdRng::from_rng(rng0).
    seed = [1, 0, 0, 0, 23, 0, 0, 0, 200, 1, 0, 0, 210, 30, 0, 0] + [0] * 16
    r0 = StdRng.from_seed(seed)
    x0 = r0.next_u64()
    r1 = StdRng.from_seed(r0.u32s(8).astype("<u4").tobytes())
    x1 = r1.next_u64()
    assert [x0, x1] == [10719222850664546238, 14064965282130556830], (x0, x1)
    # Cursor semantics across a 64-word buffer boundary and a chunk boundary.
    a = StdRng.seed_from_u64(7)
    b = StdRng.seed_from_u64(7)
    a.u32s(63)
    b.u32s(63)
    assert a.next_u64() == int(b.u32s(1)[0]) | (int(b.u32s(1)[0]) << 32)
    big = StdRng.seed_from_u64(9).u32s(StdRng.CHUNK_BLOCKS * 16 + 5)
    c = StdRng.seed_from_u64(9)
    parts = np.concatenate([c.u32s(StdRng.CHUNK_BLOCKS * 16 - 3), c.u32s(8)])
    assert (parts == big).all()
    # grammar_text: same first sentences as the Rust generator's xorshift.
    assert grammar_text(2).count(".") == 2
    print("self-test ok")


# ----------------------------------------------------------------------------------------------
# The test text: cli/tests/train.rs grammar_text, exactly (a xorshift64 with a fixed state).
# ----------------------------------------------------------------------------------------------

SUBJ = ["the cat", "a dog", "my friend", "the old man", "her sister", "our teacher"]
VERB = ["sees", "likes", "finds", "carries", "paints", "follows"]
OBJ = ["a red ball", "the garden", "two birds", "his hat", "the river", "a small boat"]


def grammar_text(sentences):
    state = 0x2545F4914F6CDD1D

    def pick(n):
        nonlocal state
        state ^= (state << 13) & MASK64
        state ^= state >> 7
        state ^= (state << 17) & MASK64
        return state % n

    out = []
    for _ in range(sentences):
        s = SUBJ[pick(6)]
        v = VERB[pick(6)]
        o = OBJ[pick(6)]
        out.append(f"{s} {v} {o}.")
    return " ".join(out)


# ----------------------------------------------------------------------------------------------
# Data (cli/src/train/data.rs read_text) and its entropies.
# ----------------------------------------------------------------------------------------------

def read_text(path):
    with open(path, "rb") as f:
        text = f.read().decode("utf-8")
    vocab = sorted(set(text))
    index = {c: i for i, c in enumerate(vocab)}
    tokens = np.array([index[c] for c in text], dtype=np.int64)
    assert len(tokens) >= 200, "a language model needs at least 200 characters"
    cut = len(tokens) - len(tokens) // 10
    return vocab, tokens[:cut], tokens[cut:]


def unigram_entropy(train, vocab_size):
    counts = np.bincount(train, minlength=vocab_size).astype(np.float64)
    p = counts[counts > 0] / len(train)
    return float(-(p * np.log(p)).sum())


def bigram_entropy(train, vocab_size):
    """H(next | previous) of the training part's bigram counts, nats per character."""
    pairs = np.zeros((vocab_size, vocab_size), dtype=np.float64)
    np.add.at(pairs, (train[:-1], train[1:]), 1.0)
    n = pairs.sum()
    rows = pairs.sum(axis=1, keepdims=True)
    nz = pairs > 0
    cond = np.where(nz, pairs / np.maximum(rows, 1), 1.0)
    return float(-(pairs[nz] / n * np.log(cond[nz])).sum())


# ----------------------------------------------------------------------------------------------
# The model.
# ----------------------------------------------------------------------------------------------

def param_shapes(vocab, context, dim, layers):
    """Starling's tensors by name (candle's names: Linear weight [out, in], embeddings)."""
    shapes = {}
    for l in range(layers):
        p = f"block{l}."
        shapes[p + "ln1.weight"] = (dim,)
        shapes[p + "ln1.bias"] = (dim,)
        shapes[p + "qkv.weight"] = (3 * dim, dim)
        shapes[p + "qkv.bias"] = (3 * dim,)
        shapes[p + "proj.weight"] = (dim, dim)
        shapes[p + "proj.bias"] = (dim,)
        shapes[p + "ln2.weight"] = (dim,)
        shapes[p + "ln2.bias"] = (dim,)
        shapes[p + "fc.weight"] = (4 * dim, dim)
        shapes[p + "fc.bias"] = (4 * dim,)
        shapes[p + "out.weight"] = (dim, 4 * dim)
        shapes[p + "out.bias"] = (dim,)
    shapes["tok_emb.embeddings"] = (vocab, dim)
    shapes["pos_emb.embeddings"] = (context, dim)
    shapes["ln_f.weight"] = (dim,)
    shapes["ln_f.bias"] = (dim,)
    shapes["head.weight"] = (vocab, dim)
    shapes["head.bias"] = (vocab,)
    return shapes


def init_rule(name):
    if ".ln" in name or name.startswith("ln"):
        return ("const", 1.0) if name.endswith("weight") else ("zeros",)
    if "emb" in name:
        return ("normal", 0.0, 0.02)
    if name.endswith("bias"):
        return ("zeros",)
    return ("torch_linear",)


def fill(rule, shape, rng):
    n = int(np.prod(shape))
    kind = rule[0]
    if kind == "zeros":
        return np.zeros(n, dtype=np.float32)
    if kind == "const":
        return np.full(n, rule[1], dtype=np.float32)
    if kind == "normal":
        mean, std = float(np.float32(rule[1])), float(np.float32(rule[2]))
        pairs = (n + 1) // 2
        u = rng.f64s(2 * pairs)
        u1 = 1.0 - u[0::2]
        u2 = u[1::2]
        r = np.sqrt(-2.0 * np.log(u1))
        theta = (2.0 * math.pi) * u2
        out = np.empty(2 * pairs, dtype=np.float32)
        out[0::2] = (mean + std * r * np.cos(theta)).astype(np.float32)
        out[1::2] = (mean + std * r * np.sin(theta)).astype(np.float32)
        return out[:n]
    if kind == "torch_linear":
        fan_in = int(np.prod(shape[1:]))
        b = np.float32(1.0 / math.sqrt(fan_in))
        low, high = -b, b
        width = np.float32(high - low)
        x = low + width * rng.f32s(n)
        x = np.where(x >= high, max(low, np.nextafter(high, np.float32(-np.inf))), x)
        return x.astype(np.float32)
    raise ValueError(kind)


def init_params(shapes, seed):
    rng = StdRng.seed_from_u64(seed)
    return {name: fill(init_rule(name), shapes[name], rng).reshape(shapes[name])
            for name in sorted(shapes)}


def build_model(torch, vocab, context, dim, layers, heads, seed, detach_norms):
    F = torch.nn.functional
    shapes = param_shapes(vocab, context, dim, layers)
    values = init_params(shapes, seed)
    params = {n: torch.nn.Parameter(torch.from_numpy(v.copy())) for n, v in values.items()}
    mask = torch.triu(torch.full((context, context), -1e9), diagonal=1)

    def ln(x, prefix):
        y = F.layer_norm(x, (dim,), params[prefix + ".weight"], params[prefix + ".bias"], 1e-5)
        return y.detach() if detach_norms else y

    def linear(x, prefix):
        return F.linear(x, params[prefix + ".weight"], params[prefix + ".bias"])

    def logits(x):
        b, t = x.shape
        h = params["tok_emb.embeddings"][x] + params["pos_emb.embeddings"][:t]
        dh = dim // heads
        for l in range(layers):
            p = f"block{l}"
            qkv = linear(ln(h, p + ".ln1"), p + ".qkv").reshape(b, t, 3, heads, dh)
            qkv = qkv.permute(2, 0, 3, 1, 4)
            q, k, v = qkv[0], qkv[1], qkv[2]
            att = (q @ k.transpose(-1, -2)) / math.sqrt(dh)
            att = torch.softmax(att + mask[:t, :t], dim=-1)
            if detach_norms:
                att = att.detach()
            y = (att @ v).transpose(1, 2).reshape(b, t, dim)
            h = h + linear(y, p + ".proj")
            m = F.gelu(linear(ln(h, p + ".ln2"), p + ".fc"), approximate="tanh")
            h = h + linear(m, p + ".out")
        flat = h.reshape(b * t, dim)
        return linear(ln(flat, "ln_f"), "head")

    def loss(x, y):
        return F.cross_entropy(logits(x), y.reshape(-1))

    return params, loss


def windows(tokens, starts, context):
    idx = np.asarray(starts)[:, None] + np.arange(context)[None, :]
    return tokens[idx], tokens[idx + 1]


def evaluate(torch, loss, val, context):
    assert len(val) > context, "validation text shorter than the context"
    n = min(max((len(val) - 1) // context, 1), 64)
    starts = [w * context for w in range(n)]
    total = 0.0
    with torch.no_grad():
        for i in range(0, n, 16):
            chunk = starts[i:i + 16]
            x, y = windows(val, chunk, context)
            l = loss(torch.from_numpy(x), torch.from_numpy(y)).item()
            total += float(np.float32(l)) * len(chunk)
    return total / n


def train(args):
    import torch

    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    vocab, tr, val = read_text(args.text)
    V = len(vocab)
    print(json.dumps({
        "vocab": V, "train_chars": int(len(tr)), "val_chars": int(len(val)),
        "unigram_entropy": round(unigram_entropy(tr, V), 6),
        "bigram_entropy": round(bigram_entropy(tr, V), 6),
        "uniform": round(math.log(V), 6),
    }), flush=True)
    assert args.dim % args.heads == 0, "--dim must be a multiple of --heads"
    assert len(tr) > args.context + 1 and len(val) > args.context + 1, "text too short"
    params, loss = build_model(torch, V, args.context, args.dim, args.layers, args.heads,
                               args.seed, args.detach_norms)
    opt = torch.optim.AdamW(list(params.values()), lr=args.lr, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=args.weight_decay, foreach=False)
    sampler = StdRng.seed_from_u64(args.seed if args.sample_seed is None else args.sample_seed)
    eval_at = sorted({int(s) for s in args.eval_at.split(",") if s.strip()})
    started = time.time()
    train_sum, train_n = 0.0, 0

    def report(step):
        nonlocal train_sum, train_n
        line = {"step": step, "val_loss": round(evaluate(torch, loss, val, args.context), 6)}
        if train_n:
            line["train_loss"] = round(train_sum / train_n, 6)
        line["seconds"] = round(time.time() - started, 2)
        print(json.dumps(line), flush=True)
        train_sum, train_n = 0.0, 0

    if 0 in eval_at:
        report(0)
    for step in range(1, args.steps + 1):
        starts = [sampler.gen_range(0, len(tr) - args.context) for _ in range(args.batch_size)]
        x, y = windows(tr, starts, args.context)
        l = loss(torch.from_numpy(x), torch.from_numpy(y))
        opt.zero_grad(set_to_none=True)
        l.backward()
        opt.step()
        lv = l.item()
        if not math.isfinite(lv):
            sys.exit(f"the loss is {lv} at step {step}: training diverged")
        train_sum += lv
        train_n += 1
        if step in eval_at:
            report(step)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--write-text", metavar="PATH")
    ap.add_argument("--sentences", type=int, default=20000)
    ap.add_argument("--self-test", action="store_true")
    ap.add_argument("--text", metavar="PATH")
    ap.add_argument("--dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--context", type=int, default=32)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--weight-decay", type=float, default=0.0)
    ap.add_argument("--steps", type=int, default=150)
    ap.add_argument("--eval-at", default="", help="comma-separated steps (0: before training)")
    ap.add_argument("--seed", type=int, default=0, help="initial parameters (the run's --seed)")
    ap.add_argument("--sample-seed", type=int, default=None,
                    help="the batch sampler's seed (default: --seed)")
    ap.add_argument("--detach-norms", action="store_true",
                    help="cut the graph at every layer norm's output and the attention softmax")
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    if args.self_test:
        self_test()
    elif args.write_text:
        with open(args.write_text, "w", encoding="utf-8", newline="") as f:
            f.write(grammar_text(args.sentences))
    elif args.text:
        if not args.eval_at:
            args.eval_at = str(args.steps)
        train(args)
    else:
        ap.error("give --text PATH, --write-text PATH or --self-test")


if __name__ == "__main__":
    main()
