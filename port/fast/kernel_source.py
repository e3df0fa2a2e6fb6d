"""The CUDA source of port/fast/kernels.py's bucketed-block attention: the split kernel (fp32
FMA, and on bf16 tensor cores) and the combine kernel, as MLX's cuda_kernel takes them (bodies;
the tensor-core device functions as a header). port/fast/kernels.py says what they compute and why."""

# Both split kernels start here: which keys of [context rows 0..valid-1 ; block rows] this CUDA
# block walks (its split's whole tiles of TK keys).
KEYS = """
constexpr int REP = HQ / HKV;
constexpr int R = REP * L;
const int split = blockIdx.x, g = blockIdx.y, splits = gridDim.x;
const int nv = valid[0];
const int N = nv + L;
const int tiles = (N + TK - 1) / TK;
const int n0 = min(N, (int)((long long)split * tiles / splits) * TK);
const int n1 = min(N, (int)((long long)(split + 1) * tiles / splits) * TK);
const float sc = __int_as_float(SCALE);
"""

SPLIT = KEYS + """
constexpr int G4 = D / 16;
const int tid = threadIdx.x, lane = tid & 3;
const int r = blockIdx.z * RPB + (tid >> 2);
const bool live = r < R;
const int h = g * REP + (live ? r / L : 0);
const int i = live ? r % L : 0;

__shared__ float4 ks[TK][D / 4];
__shared__ float4 vs[TK][D / 4];

float4 qr[G4], acc[G4];
#pragma unroll
for (int j = 0; j < G4; ++j) {
  const int d = 4 * (lane + 4 * j);
  float4 v = make_float4(0.f, 0.f, 0.f, 0.f);
  if (live) {
    const long long o = h * q_strides[1] + i * q_strides[2];
    v.x = static_cast<float>(q[o + (d + 0) * q_strides[3]]) * sc;
    v.y = static_cast<float>(q[o + (d + 1) * q_strides[3]]) * sc;
    v.z = static_cast<float>(q[o + (d + 2) * q_strides[3]]) * sc;
    v.w = static_cast<float>(q[o + (d + 3) * q_strides[3]]) * sc;
  }
  qr[j] = v;
  acc[j] = make_float4(0.f, 0.f, 0.f, 0.f);
}
float m = -INFINITY, l = 0.f;

constexpr int NT = RPB * 4;
constexpr int NL = (TK * D + NT - 1) / NT;
float kr[NL], vr[NL];
auto fetch = [&](int t0) {
#pragma unroll
  for (int e = 0; e < NL; ++e) {
    const int idx = e * NT + tid, k = idx / D, d = idx % D, n = t0 + k;
    kr[e] = 0.f;
    vr[e] = 0.f;
    if (idx < TK * D && n < n1) {
      if (n < nv) {
        kr[e] = static_cast<float>(ck[g * ck_strides[1] + n * ck_strides[2] + d * ck_strides[3]]);
        vr[e] = static_cast<float>(cv[g * cv_strides[1] + n * cv_strides[2] + d * cv_strides[3]]);
      } else {
        kr[e] = static_cast<float>(bk[g * bk_strides[1] + (n - nv) * bk_strides[2] + d * bk_strides[3]]);
        vr[e] = static_cast<float>(bv[g * bv_strides[1] + (n - nv) * bv_strides[2] + d * bv_strides[3]]);
      }
    }
  }
};

if (n0 < n1) fetch(n0);
for (int t0 = n0; t0 < n1; t0 += TK) {
  __syncthreads();
#pragma unroll
  for (int e = 0; e < NL; ++e) {
    const int idx = e * NT + tid;
    if (idx < TK * D) {
      reinterpret_cast<float*>(ks[idx / D])[idx % D] = kr[e];
      reinterpret_cast<float*>(vs[idx / D])[idx % D] = vr[e];
    }
  }
  __syncthreads();
  if (t0 + TK < n1) fetch(t0 + TK);
  float s[TK];
  float tmax = -INFINITY;
#pragma unroll
  for (int k = 0; k < TK; ++k) {
    float p = 0.f;
#pragma unroll
    for (int j = 0; j < G4; ++j) {
      const float4 kk = ks[k][lane + 4 * j];
      p += qr[j].x * kk.x + qr[j].y * kk.y + qr[j].z * kk.z + qr[j].w * kk.w;
    }
    p += __shfl_xor_sync(0xffffffff, p, 1);
    p += __shfl_xor_sync(0xffffffff, p, 2);
    const int n = t0 + k;
    const bool seen = live && n < n1 &&
        (n < nv ? (W == 0 || nv + i - n < W) : (!CAUSAL || n - nv <= i));
    s[k] = seen ? p : -INFINITY;
    tmax = fmaxf(tmax, s[k]);
  }
  const float mnew = fmaxf(m, tmax);
  if (mnew != -INFINITY) {
    const float alpha = expf(m - mnew);
    l *= alpha;
#pragma unroll
    for (int j = 0; j < G4; ++j) {
      acc[j].x *= alpha; acc[j].y *= alpha; acc[j].z *= alpha; acc[j].w *= alpha;
    }
#pragma unroll
    for (int k = 0; k < TK; ++k) {
      const float p = expf(s[k] - mnew);
      l += p;
#pragma unroll
      for (int j = 0; j < G4; ++j) {
        const float4 vv = vs[k][lane + 4 * j];
        acc[j].x += p * vv.x; acc[j].y += p * vv.y; acc[j].z += p * vv.z; acc[j].w += p * vv.w;
      }
    }
    m = mnew;
  }
}

if (live) {
  const long long row = (long long)split * HQ * L + h * L + i;
#pragma unroll
  for (int j = 0; j < G4; ++j) {
    reinterpret_cast<float4*>(po + row * D)[lane + 4 * j] = acc[j];
  }
  if (lane == 0) {
    pm[row] = m;
    pl[row] = l;
  }
}
"""

MMA_HEADER = """
__device__ __forceinline__ void mma_bf16(float* c, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\\n"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t pack_bf16(__nv_bfloat16 lo, __nv_bfloat16 hi) {
  __nv_bfloat162 v = __halves2bfloat162(lo, hi);
  return *reinterpret_cast<uint32_t*>(&v);
}
__device__ __forceinline__ void pack_split(float a, float b, uint32_t& hi, uint32_t& lo) {
  const __nv_bfloat16 ah = __float2bfloat16(a), bh = __float2bfloat16(b);
  hi = pack_bf16(ah, bh);
  lo = pack_bf16(__float2bfloat16(a - __bfloat162float(ah)), __float2bfloat16(b - __bfloat162float(bh)));
}
"""

# The split kernel on bf16 tensor cores (mma.sync m16n8k16, fp32 accumulation), head_dim <= 128:
# a warp owns 16 query rows; S = Q K^T and O += P V per tile of 32 keys. Q and K are bf16, so S is
# their exact products summed in fp32; P enters its product as two bf16 parts (P = hi + lo, about 16
# bits kept, where flash attention rounds P to one bf16), the softmax's max and sum in fp32.
MMA = KEYS + """
static_assert(TK == 32, "four n-tiles of 8 keys, two k-steps of 16");
constexpr int KS = D / 16;
constexpr int DN = D / 8;
constexpr int KP = D + 8;
constexpr int VP = TK + 8;
constexpr int NT = WARPS * 32;
constexpr int NP = (TK * D / 2 + NT - 1) / NT;
const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
const int gid = lane >> 2, tig = lane & 3;

__shared__ __align__(16) __nv_bfloat16 ks[TK * KP];
__shared__ __align__(16) __nv_bfloat16 vt[D * VP];

const int rbase = blockIdx.z * (WARPS * 16) + warp * 16;
bool live[2];
int hh[2], ii[2];
#pragma unroll
for (int x = 0; x < 2; ++x) {
  const int r = rbase + gid + 8 * x;
  live[x] = r < R;
  hh[x] = g * REP + (live[x] ? r / L : 0);
  ii[x] = live[x] ? r % L : 0;
}
// Loads go out as pairs of bf16 (one 32-bit load, its value not used until the tile is stored or
// multiplied) wherever the rows are contiguous and 4-byte aligned (MLX's buffers and projections):
// a pair packed from two 2-byte loads waits for both, one load's latency after the other.
const bool qpairs = q_strides[3] == 1 && !((q_strides[1] | q_strides[2]) & 1) && !(reinterpret_cast<unsigned long long>(q) & 3);
const bool pairs = ck_strides[3] == 1 && cv_strides[3] == 1 && bk_strides[3] == 1 && bv_strides[3] == 1 &&
    !((ck_strides[1] | ck_strides[2] | cv_strides[1] | cv_strides[2] | bk_strides[1] | bk_strides[2] |
       bv_strides[1] | bv_strides[2]) & 1) &&
    !((reinterpret_cast<unsigned long long>(ck) | reinterpret_cast<unsigned long long>(cv) |
       reinterpret_cast<unsigned long long>(bk) | reinterpret_cast<unsigned long long>(bv)) & 3);
uint32_t qa[KS][4];
#pragma unroll
for (int s = 0; s < KS; ++s) {
#pragma unroll
  for (int c = 0; c < 4; ++c) {
    const int x = c & 1, d = 16 * s + tig * 2 + (c >> 1) * 8;
    const __nv_bfloat16* qp = q + hh[x] * q_strides[1] + ii[x] * q_strides[2];
    if (qpairs) {
      qa[s][c] = live[x] ? *reinterpret_cast<const uint32_t*>(qp + d) : 0u;
    } else {
      qa[s][c] = live[x] ? pack_bf16(qp[d * q_strides[3]], qp[(d + 1) * q_strides[3]]) : 0u;
    }
  }
}
float o[DN][4];
#pragma unroll
for (int j = 0; j < DN; ++j) o[j][0] = o[j][1] = o[j][2] = o[j][3] = 0.f;
float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};

uint32_t kr[NP], vr[NP];
// Key n's K and V rows: context row n below nv, else block row n - nv.
auto row = [&](int n, const __nv_bfloat16*& kp, const __nv_bfloat16*& vp, long long& ks, long long& vs) {
  const bool ctx = n < nv;
  kp = ctx ? ck + g * ck_strides[1] + n * ck_strides[2] : bk + g * bk_strides[1] + (n - nv) * bk_strides[2];
  vp = ctx ? cv + g * cv_strides[1] + n * cv_strides[2] : bv + g * bv_strides[1] + (n - nv) * bv_strides[2];
  ks = ctx ? ck_strides[3] : bk_strides[3];
  vs = ctx ? cv_strides[3] : bv_strides[3];
};
auto fetch = [&](int t0) {
  if (pairs) {
#pragma unroll
    for (int e = 0; e < NP; ++e) {
      const int idx = e * NT + tid, k = idx / (D / 2), d = (idx % (D / 2)) * 2, n = t0 + k;
      const bool ok = idx < TK * D / 2 && n < n1;
      const __nv_bfloat16 *kp, *vp;
      long long ks, vs;
      row(n, kp, vp, ks, vs);
      kr[e] = ok ? *reinterpret_cast<const uint32_t*>(kp + d) : 0u;
      vr[e] = ok ? *reinterpret_cast<const uint32_t*>(vp + d) : 0u;
    }
  } else {
#pragma unroll
    for (int e = 0; e < NP; ++e) {
      const int idx = e * NT + tid, k = idx / (D / 2), d = (idx % (D / 2)) * 2, n = t0 + k;
      const bool ok = idx < TK * D / 2 && n < n1;
      const __nv_bfloat16 *kp, *vp;
      long long ks, vs;
      row(n, kp, vp, ks, vs);
      kr[e] = ok ? pack_bf16(kp[d * ks], kp[(d + 1) * ks]) : 0u;
      vr[e] = ok ? pack_bf16(vp[d * vs], vp[(d + 1) * vs]) : 0u;
    }
  }
};

if (n0 < n1) fetch(n0);
for (int t0 = n0; t0 < n1; t0 += TK) {
  __syncthreads();
#pragma unroll
  for (int e = 0; e < NP; ++e) {
    const int idx = e * NT + tid, k = idx / (D / 2), d = (idx % (D / 2)) * 2;
    if (idx < TK * D / 2) {
      *reinterpret_cast<uint32_t*>(&ks[k * KP + d]) = kr[e];
      __nv_bfloat162 v = *reinterpret_cast<__nv_bfloat162*>(&vr[e]);
      vt[d * VP + k] = v.x;
      vt[(d + 1) * VP + k] = v.y;
    }
  }
  __syncthreads();
  if (t0 + TK < n1) fetch(t0 + TK);

  float sf[4][4];
#pragma unroll
  for (int j = 0; j < 4; ++j) {
    sf[j][0] = sf[j][1] = sf[j][2] = sf[j][3] = 0.f;
#pragma unroll
    for (int s = 0; s < KS; ++s) {
      const __nv_bfloat16* kp = &ks[(8 * j + gid) * KP + 16 * s + tig * 2];
      mma_bf16(sf[j], qa[s], *reinterpret_cast<const uint32_t*>(kp), *reinterpret_cast<const uint32_t*>(kp + 8));
    }
  }
  float tmax[2] = {-INFINITY, -INFINITY};
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int x = c >> 1, n = t0 + 8 * j + tig * 2 + (c & 1);
      const bool seen = live[x] && n < n1 &&
          (n < nv ? (W == 0 || nv + ii[x] - n < W) : (!CAUSAL || n - nv <= ii[x]));
      sf[j][c] = seen ? sf[j][c] * sc : -INFINITY;
      tmax[x] = fmaxf(tmax[x], sf[j][c]);
    }
  }
  float alpha[2], mnew[2];
#pragma unroll
  for (int x = 0; x < 2; ++x) {
    tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 1));
    tmax[x] = fmaxf(tmax[x], __shfl_xor_sync(0xffffffff, tmax[x], 2));
    mnew[x] = fmaxf(m[x], tmax[x]);
    alpha[x] = mnew[x] == -INFINITY ? 1.f : expf(m[x] - mnew[x]);
    l[x] *= alpha[x];
    m[x] = mnew[x];
  }
#pragma unroll
  for (int j = 0; j < 4; ++j) {
#pragma unroll
    for (int c = 0; c < 4; ++c) {
      const int x = c >> 1;
      sf[j][c] = sf[j][c] == -INFINITY ? 0.f : expf(sf[j][c] - mnew[x]);
      l[x] += sf[j][c];
    }
  }
#pragma unroll
  for (int j = 0; j < DN; ++j) {
    o[j][0] *= alpha[0]; o[j][1] *= alpha[0]; o[j][2] *= alpha[1]; o[j][3] *= alpha[1];
  }
#pragma unroll
  for (int s = 0; s < 2; ++s) {
    uint32_t ph[4], pr[4];
    pack_split(sf[2 * s][0], sf[2 * s][1], ph[0], pr[0]);
    pack_split(sf[2 * s][2], sf[2 * s][3], ph[1], pr[1]);
    pack_split(sf[2 * s + 1][0], sf[2 * s + 1][1], ph[2], pr[2]);
    pack_split(sf[2 * s + 1][2], sf[2 * s + 1][3], ph[3], pr[3]);
#pragma unroll
    for (int j = 0; j < DN; ++j) {
      const __nv_bfloat16* vp = &vt[(8 * j + gid) * VP + 16 * s + tig * 2];
      const uint32_t b0 = *reinterpret_cast<const uint32_t*>(vp), b1 = *reinterpret_cast<const uint32_t*>(vp + 8);
      mma_bf16(o[j], ph, b0, b1);
      mma_bf16(o[j], pr, b0, b1);
    }
  }
}

#pragma unroll
for (int x = 0; x < 2; ++x) {
  l[x] += __shfl_xor_sync(0xffffffff, l[x], 1);
  l[x] += __shfl_xor_sync(0xffffffff, l[x], 2);
  if (live[x]) {
    const long long row = (long long)split * HQ * L + hh[x] * L + ii[x];
#pragma unroll
    for (int j = 0; j < DN; ++j) {
      reinterpret_cast<float2*>(po + row * D + 8 * j + tig * 2)[0] = make_float2(o[j][2 * x], o[j][2 * x + 1]);
    }
    if (tig == 0) {
      pm[row] = m[x];
      pl[row] = l[x];
    }
  }
}
"""

COMBINE = """
const long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x;
const int rows = HQ * L;
if (t >= (long long)rows * D) return;
const int row = t / D, d = t % D, splits = pm_shape[0];
float mx_ = -INFINITY;
#pragma unroll 8
for (int s = 0; s < splits; ++s) mx_ = fmaxf(mx_, pm[s * rows + row]);
float num = 0.f, den = 0.f;
#pragma unroll 8
for (int s = 0; s < splits; ++s) {
  const float m = pm[s * rows + row];
  if (m == -INFINITY) continue;
  const float w = expf(m - mx_);
  den += pl[s * rows + row] * w;
  num += po[((long long)s * rows + row) * D + d] * w;
}
const int h = row / L, i = row % L;
out[((long long)i * HQ + h) * D + d] = static_cast<T>(num / den);
"""
