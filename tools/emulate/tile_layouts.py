# Emulates the Hopper kernel's per-tile copy plan and shared-memory reads for both
# key formats: checks that every read finds the intended cache bytes, that copies
# stay inside the stage without overlapping, and that reads are bank-conflict free.
import random

def check(fp8, Hk=3, head=1, block_size=32, slot0=16):
    T = 16
    if fp8:
        KB, REC, F = 128, 192, 2
        VA, META = 2048, 3072; STAGE = META + 64
    else:
        KB, REC, F = 64, 128, 3
        META = 2048; STAGE = META + 128
    slot_stride = Hk * REC
    meta_region = block_size * Hk * REC
    block = [random.randrange(256) for _ in range(meta_region + 2 * Hk * F * block_size)]
    def rec(t):  # record bytes of token t (slot slot0 + t)
        o = (slot0 + t) * slot_stride + head * REC
        return block[o:o + REC]
    def field_bytes(f, t):
        o = meta_region + 2 * ((head * F + f) * block_size + slot0 + t)
        return block[o:o + 2]
    stage = [None] * STAGE
    owner = {}
    def cp(dst, src, lane):
        assert 0 <= dst and dst + 16 <= STAGE and dst % 16 == 0 and src % 16 == 0, (dst, src)
        for i in range(16):
            assert dst + i not in owner, ("overlap", dst + i, lane)
            owner[dst + i] = lane
            stage[dst + i] = block[src + i]
    def swz(t): return ((t & 1) << 2) ^ (t & 6)
    for lane in range(32):
        token, half = lane >> 1, lane & 1
        if fp8:
            source = token * slot_stride + head * REC + 64 * half
            swapped = token & 1
            kd0 = token * KB + 64 * half + 16 * swapped
            kd1 = token * KB + 64 * half + 16 * (1 - swapped)
            row = token >> 1
            vd = VA + row * 128 + (((4 * (token & 1) + 2 * half) ^ (2 * (row & 3))) << 4)
            keys = slot0 * slot_stride + source
            values = keys + (KB - 64 * half) + 32 * half
            cp(kd0, keys, lane); cp(kd1, keys + 16, lane); cp(kd0 + 32, keys + 32, lane); cp(kd1 + 32, keys + 48, lane)
            cp(vd, values, lane); cp(vd + 16, values + 16, lane)
        else:
            ps = swz(token) & 2
            source = token * slot_stride + head * REC + 64 * half + 16 * ps
            delta = -32 if ps else 32
            dest = token * REC + 16 * ((4 * half) ^ (swz(token) & 4))
            first = slot0 * slot_stride + source; second = first + delta
            cp(dest, first, lane); cp(dest + 16, first + 16, lane); cp(dest + 32, second, lane); cp(dest + 48, second + 16, lane)
        field = lane >> 1
        if lane < 2 * F:
            ms = meta_region + 2 * (head * F + field) * block_size + 16 * half
            cp(META + 32 * field + 16 * half, 2 * slot0 + ms, lane)
    # reads
    def key_off(t, c, part):
        if fp8: return t * KB + (((2 * c + part) ^ (t & 1)) << 4)
        return t * REC + ((c ^ swz(t)) << 4)
    def val_off(t, g):
        if fp8:
            row = t >> 1
            return VA + row * 128 + (((4 * (t & 1) + (g >> 1)) ^ (2 * (row & 3))) << 4) + 8 * (g & 1)
        return t * REC + (((4 + (g >> 1)) ^ swz(t)) << 4) + 8 * (g & 1)
    parts = 2 if fp8 else 1
    for t in range(T):
        r = rec(t)
        for c in range(4):
            for part in range(parts):
                o = key_off(t, c, part)
                want = r[32 * c + 16 * part: 32 * c + 16 * part + 16] if fp8 else r[16 * c: 16 * c + 16]
                assert stage[o:o + 16] == want, ("key", fp8, t, c, part)
        for g in range(8):
            o = val_off(t, g)
            assert stage[o:o + 8] == r[KB + 8 * g: KB + 8 * g + 8], ("value", fp8, t, g)
        for f in range(F):
            o = META + 32 * f + 2 * t
            assert stage[o:o + 2] == field_bytes(f, t), ("field", fp8, f, t)
    # bank conflicts: 16-byte loads in phases of 8 lanes, 8-byte loads in phases of 16 lanes
    def conflict_free(addresses, width):
        words = set()
        banks = {}
        for a in addresses:
            for w in range(a // 4, (a + width) // 4):
                banks.setdefault(w % 32, set()).add(w)
        return all(len(v) == 1 for v in banks.values())
    for j in range(2):
        for part in range(parts):
            for phase in range(4):
                lanes = range(8 * phase, 8 * phase + 8)
                addrs = [key_off(8 * j + (l >> 2), l & 3, part) for l in lanes]
                assert conflict_free(addrs, 16), ("key bank conflict", fp8, j, part, phase)
    for k in range(4):
        for phase in range(2):
            lanes = range(16 * phase, 16 * phase + 16)
            addrs = [val_off(2 * (l & 3) + (k & 1) + 8 * (k >> 1), l >> 2) for l in lanes]
            assert conflict_free(addrs, 8), ("value bank conflict", fp8, k, phase)
    return True

random.seed(1)
for fp8 in (False, True):
    for Hk in (1, 3, 8):
        for head in range(Hk):
            for bs, s0 in ((16, 0), (32, 16), (128, 96)):
                check(fp8, Hk, head, bs, s0)
    print("fp8" if fp8 else "4bit", "layout: reads find their bytes, copies disjoint and in bounds, reads conflict-free")
