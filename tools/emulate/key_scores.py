# Emulates S^T = K Q^T of one tile as the kernel builds it (per-lane A and B
# fragments of mma.m16n8k16, k-step by k-step) for each key format and compares
# every lane's C fragment with the direct dot products.
import random, struct
import numpy as np

def e4m3_to_float(b):
    s = -1.0 if b & 0x80 else 1.0
    e = (b >> 3) & 0xF; m = b & 7
    if e == 0xF and m == 7: return float('nan')
    if e == 0: return s * (m / 8) * 2.0 ** -6
    return s * (1 + m / 8) * 2.0 ** (e - 7)

def run(fmt, seed):
    rng = random.Random(seed)
    D, T, H = 128, 16, 8
    q = np.array([[rng.uniform(-1, 1) for _ in range(D)] for _ in range(H)])
    if fmt == 'fp8':
        keybytes = [[rng.randrange(256) for _ in range(D)] for _ in range(T)]
        for t in range(T):  # no NaN encodings
            keybytes[t] = [b if (b & 0x7f) != 0x7f else 0 for b in keybytes[t]]
        K = np.array([[e4m3_to_float(b) for b in keybytes[t]] for t in range(T)])
    else:
        bits = 4 if fmt == 'mse4' else 3
        cent = [rng.uniform(-2, 2) for _ in range(1 << bits)]
        codes = [[rng.randrange(1 << bits) for _ in range(D)] for _ in range(T)]
        K = np.array([[cent[c] for c in codes[t]] for t in range(T)])
        packed = []
        for t in range(T):
            v = 0
            for d, c in enumerate(codes[t]): v |= c << (bits * d)
            packed.append(v.to_bytes(D * bits // 8, 'little'))
        # lookup table: entry -> (centroid[low], centroid[high])
        mask = (1 << bits) - 1
        lut = {e: (cent[e & mask], cent[e >> bits]) for e in range(1 << (2 * bits))}
    S = np.zeros((T, H))
    # fragments, k-step by k-step
    for ks in range(8):
        A = np.full((16, 16), np.nan); B = np.full((16, 8), np.nan)
        for lane in range(32):
            g, c = lane >> 2, lane & 3
            def a_pair(token, second):
                # the kernel's A register: (dims pair) as two values, low half first
                if fmt == 'fp8':
                    words = [int.from_bytes(bytes(keybytes[token][32 * c + 4 * w: 32 * c + 4 * w + 4]), 'little') for w in range(8)]
                    x = words[ks] >> (16 if second else 0)
                    return e4m3_to_float(x & 0xff), e4m3_to_float((x >> 8) & 0xff)
                if fmt == 'mse4':
                    key16 = packed[token][16 * c: 16 * c + 16]
                    words = [int.from_bytes(key16[4 * w: 4 * w + 4], 'little') for w in range(4)]
                    w = ks // 2
                    byte = (ks % 2) * 2 + (1 if second else 0)
                    shift = {0: 7, 1: -1, 2: -9, 3: -17}[byte]
                    off = ((words[w] << shift) if shift >= 0 else (words[w] >> -shift)) & 0x7f80
                    return lut[off >> 7]
                key12 = packed[token][12 * c: 12 * c + 12]
                words = [int.from_bytes(key12[4 * w: 4 * w + 4], 'little') for w in range(3)]
                first_bit = 12 * ks + (6 if second else 0)
                word = first_bit >> 5; shift = (first_bit & 31) - 7
                if shift < 0: x = (words[word] << -shift) & 0xffffffff
                elif word + 1 < 3: x = (((words[word + 1] << 32) | words[word]) >> shift) & 0xffffffff
                else: x = words[word] >> shift
                return lut[(x & 0x1f80) >> 7]
            a = [a_pair(g, False), a_pair(g + 8, False), a_pair(g, True), a_pair(g + 8, True)]
            rows = [g, g + 8, g, g + 8]; cols = [2 * c, 2 * c, 2 * c + 8, 2 * c + 8]
            for r in range(4):
                for h in range(2):
                    cur = A[rows[r], cols[r] + h]
                    assert np.isnan(cur), "A element written twice"
                    A[rows[r], cols[r] + h] = a[r][h]
            d = 32 * c + 4 * ks
            bq = [(q[g][d], q[g][d + 1]), (q[g][d + 2], q[g][d + 3])]
            for r, krow in enumerate((2 * c, 2 * c + 8)):
                B[krow, g] = bq[r][0]; B[krow + 1, g] = bq[r][1]
        assert not np.isnan(A).any() and not np.isnan(B).any()
        S += A @ B  # rows tokens, columns heads
    direct = K @ q.T
    # the lanes' C fragments
    for lane in range(32):
        g, c = lane >> 2, lane & 3
        frag = [S[g, 2 * c], S[g, 2 * c + 1], S[g + 8, 2 * c], S[g + 8, 2 * c + 1]]
        want = [direct[g, 2 * c], direct[g, 2 * c + 1], direct[g + 8, 2 * c], direct[g + 8, 2 * c + 1]]
        assert np.allclose(frag, want, rtol=1e-9, atol=1e-9), (fmt, lane, frag, want)
    return True

for fmt in ('mse4', 'mse3', 'fp8'):
    for seed in range(5):
        run(fmt, seed)
    print(fmt, ": every lane's S^T fragment equals K Q^T")
