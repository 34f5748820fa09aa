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
    sector_copies = {}  # 32-byte source sector -> the copy instructions that read it
    def cp(dst, src, lane, instruction=None):
        if instruction is not None:
            sector_copies.setdefault(src // 32, set()).add(instruction)
        assert 0 <= dst and dst + 16 <= STAGE and dst % 16 == 0 and src % 16 == 0, (dst, src)
        for i in range(16):
            assert dst + i not in owner, ("overlap", dst + i, lane)
            owner[dst + i] = lane
            stage[dst + i] = block[src + i]
    def swz(t): return ((t & 1) << 2) ^ (t & 6)
    def run_copy(lane, chunks, run_offset, dest_of):
        # TokenRunCopy: copy i takes chunk lane % chunks of token tpc * i + lane // chunks
        tpc = 32 // chunks
        token, chunk = lane // chunks, lane % chunks
        source = token * slot_stride + run_offset + 16 * chunk
        dests = (dest_of(token, chunk), dest_of(token + tpc, chunk))
        for i in range(16 // tpc):
            cp(dests[i & 1] + 1024 * (i >> 1), slot0 * slot_stride + source + i * tpc * slot_stride, lane, (run_offset, i))
    def value_dest(t, k):
        row = t >> 1
        return VA + row * 128 + (((4 * (t & 1) + k) ^ (2 * (row & 3))) << 4)
    for lane in range(32):
        half = lane & 1
        if fp8:
            run_copy(lane, 8, head * REC, lambda t, k: t * KB + ((k ^ (t & 1)) << 4))
            run_copy(lane, 4, head * REC + KB, value_dest)
        else:
            run_copy(lane, 8, head * REC, lambda t, k: t * REC + ((k ^ swz(t)) << 4))
        field = lane >> 1
        if lane < 2 * F:
            ms = meta_region + 2 * (head * F + field) * block_size + 16 * half
            cp(META + 32 * field + 16 * half, 2 * slot0 + ms, lane)
    assert all(len(v) == 1 for v in sector_copies.values()), "a sector split over copy instructions"
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
