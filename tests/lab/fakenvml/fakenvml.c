/*
 * A fake libnvidia-ml.so.1 for the test lab: the NVML entry points gpufleet's agent calls,
 * backed by the same fake GPU state as tests/lab/fake_nvidia_smi.py ($FAKEGPU_ROOT, default
 * /run/fakegpu: config.json + procs/<pid>.json + procs/<pid>.dead). Built by the test suite
 * (tests/lab/fakenvml/build.py) with the system C compiler; see tests/lab/README.md.
 *
 * Why C: the real library is a C ABI loaded with dlopen/ctypes, and a query must cost well under
 * a millisecond, so benchmarks measure gpufleet rather than the fake. No Python, no subprocess.
 *
 * Signatures, return codes, constants and struct layouts are transcribed from NVIDIA's nvml.h as
 * vendored by github.com/NVIDIA/go-nvml, file pkg/nvml/nvml.h (NVML_API_VERSION 13, commit
 * 2f9e261fe40a7a1c54783d66805e8920564763b4); each struct below names its source struct.
 * Values the real H200 returned are in tests/fixtures/recorded/probe/h200-clients-probe3.log.
 *
 * The memory arithmetic (ghost, unlisted, touch, release delay, clamping) is fake_nvidia_smi.py's
 * snapshot(), line for line; tests/unit/test_fake_nvml.py checks the two agree on the same state.
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <pthread.h>
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define API __attribute__((visibility("default")))

/* --- nvml.h: return codes (enum nvmlReturn_enum) ------------------------------------------ */
typedef int nvmlReturn_t;
#define NVML_SUCCESS 0
#define NVML_ERROR_UNINITIALIZED 1
#define NVML_ERROR_INVALID_ARGUMENT 2
#define NVML_ERROR_NOT_SUPPORTED 3
#define NVML_ERROR_INSUFFICIENT_SIZE 7
#define NVML_ERROR_DRIVER_NOT_LOADED 9
#define NVML_ERROR_TIMEOUT 10
#define NVML_ERROR_GPU_IS_LOST 15
#define NVML_ERROR_ARGUMENT_VERSION_MISMATCH 25
#define NVML_ERROR_UNKNOWN 999

/* nvml.h: #define NVML_VALUE_NOT_AVAILABLE (-1); nvmlProcessInfo_v2_st: "Under WDDM,
 * NVML_VALUE_NOT_AVAILABLE is always reported" (WSL2 runs on WDDM). */
#define VALUE_NOT_AVAILABLE_ULL 0xFFFFFFFFFFFFFFFFULL
#define NOT_MIG 0xFFFFFFFFu /* nvmlProcessInfo_v2_st: gpuInstanceId "set to 0xFFFFFFFF otherwise" */

#define NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE 32
#define NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE 16
#define NVML_TEMPERATURE_GPU 0  /* enum nvmlTemperatureSensors_enum */
#define NVML_FEATURE_ENABLED 1  /* enum nvmlEnableState_enum */

/* nvml.h: typedef struct { struct nvmlDevice_st* handle; } nvmlDevice_t; (one pointer, passed
 * by value: the same ABI as passing the pointer). */
struct nvmlDevice_st {
    int index;
};
typedef struct {
    struct nvmlDevice_st *handle;
} nvmlDevice_t;

/* nvml.h: typedef struct nvmlPciInfo_st {...} nvmlPciInfo_t; (the _v3 entry point's struct) */
typedef struct {
    char busIdLegacy[NVML_DEVICE_PCI_BUS_ID_BUFFER_V2_SIZE];
    unsigned int domain;
    unsigned int bus;
    unsigned int device;
    unsigned int pciDeviceId;
    unsigned int pciSubSystemId;
    char busId[NVML_DEVICE_PCI_BUS_ID_BUFFER_SIZE];
} nvmlPciInfo_t;

/* nvml.h: typedef struct nvmlUtilization_st { gpu; memory; } nvmlUtilization_t; */
typedef struct {
    unsigned int gpu;
    unsigned int memory;
} nvmlUtilization_t;

/* nvml.h: typedef struct nvmlMemory_st { total; free; used; } nvmlMemory_t;
 * ("used: Sum of Reserved and Allocated device memory") */
typedef struct {
    unsigned long long total;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_t;

/* nvml.h: typedef struct nvmlMemory_v2_st { version; total; reserved; free; used; } */
typedef struct {
    unsigned int version;
    unsigned long long total;
    unsigned long long reserved;
    unsigned long long free;
    unsigned long long used;
} nvmlMemory_v2_t;
/* nvml.h: #define NVML_STRUCT_VERSION(data, ver) (sizeof(nvml##data##_v##ver##_t) | (ver << 24U)) */
#define nvmlMemory_v2 ((unsigned int)(sizeof(nvmlMemory_v2_t) | (2u << 24)))

/* nvml.h: typedef struct nvmlProcessInfo_v1_st { pid; usedGpuMemory; } nvmlProcessInfo_v1_t; */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
} nvmlProcessInfo_v1_t;

/* nvml.h: typedef struct nvmlProcessInfo_v2_st { pid; usedGpuMemory; gpuInstanceId;
 * computeInstanceId; } nvmlProcessInfo_v2_t, nvmlProcessInfo_t; (the _v2 and _v3 entry points) */
typedef struct {
    unsigned int pid;
    unsigned long long usedGpuMemory;
    unsigned int gpuInstanceId;
    unsigned int computeInstanceId;
} nvmlProcessInfo_t;

_Static_assert(sizeof(nvmlPciInfo_t) == 68, "nvmlPciInfo_t layout");
_Static_assert(sizeof(nvmlMemory_v2_t) == 40, "nvmlMemory_v2_t layout");
_Static_assert(sizeof(nvmlProcessInfo_v1_t) == 16, "nvmlProcessInfo_v1_t layout");
_Static_assert(sizeof(nvmlProcessInfo_t) == 24, "nvmlProcessInfo_t layout");

/* --- a small JSON reader (config.json and the holder records are tiny) ---------------------- */

enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ };
typedef struct jnode {
    int type;
    double num;
    char *str;           /* J_STR value */
    char *key;           /* member name inside an object */
    struct jnode *child; /* J_ARR / J_OBJ members */
    struct jnode *next;
} jnode;

typedef struct {
    const char *p;
    const char *end;
    int bad;
} jparser;

static void jfree(jnode *n) {
    while (n) {
        jnode *next = n->next;
        jfree(n->child);
        free(n->str);
        free(n->key);
        free(n);
        n = next;
    }
}

static void jws(jparser *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\n' || *j->p == '\r' || *j->p == '\t'))
        j->p++;
}

static char *jstring(jparser *j) {
    /* at the opening quote */
    size_t cap = 16, len = 0;
    char *out = malloc(cap);
    if (!out) { j->bad = 1; return NULL; }
    j->p++;
    while (j->p < j->end && *j->p != '"') {
        char c = *j->p++;
        if (c == '\\' && j->p < j->end) {
            char e = *j->p++;
            switch (e) {
            case 'n': c = '\n'; break;
            case 't': c = '\t'; break;
            case 'r': c = '\r'; break;
            case 'b': c = '\b'; break;
            case 'f': c = '\f'; break;
            case 'u': {
                unsigned v = 0;
                for (int k = 0; k < 4 && j->p < j->end; k++, j->p++) {
                    char h = *j->p;
                    v = v * 16 + (unsigned)(h >= 'a' ? h - 'a' + 10 : h >= 'A' ? h - 'A' + 10 : h - '0');
                }
                c = v < 128 ? (char)v : '?'; /* state files are ASCII */
                break;
            }
            default: c = e;
            }
        }
        if (len + 2 > cap) {
            cap *= 2;
            char *grown = realloc(out, cap);
            if (!grown) { free(out); j->bad = 1; return NULL; }
            out = grown;
        }
        out[len++] = c;
    }
    if (j->p >= j->end) j->bad = 1;
    else j->p++;
    out[len] = 0;
    return out;
}

static jnode *jvalue(jparser *j, int depth) {
    jws(j);
    if (j->p >= j->end || depth > 32) { j->bad = 1; return NULL; }
    jnode *n = calloc(1, sizeof(*n));
    if (!n) { j->bad = 1; return NULL; }
    char c = *j->p;
    if (c == '{' || c == '[') {
        n->type = c == '{' ? J_OBJ : J_ARR;
        char close = c == '{' ? '}' : ']';
        jnode **tail = &n->child;
        j->p++;
        jws(j);
        if (j->p < j->end && *j->p == close) { j->p++; return n; }
        while (!j->bad) {
            char *key = NULL;
            if (n->type == J_OBJ) {
                jws(j);
                if (j->p >= j->end || *j->p != '"') { j->bad = 1; break; }
                key = jstring(j);
                jws(j);
                if (j->p >= j->end || *j->p != ':') { free(key); j->bad = 1; break; }
                j->p++;
            }
            jnode *m = jvalue(j, depth + 1);
            if (!m) { free(key); break; }
            m->key = key;
            *tail = m;
            tail = &m->next;
            jws(j);
            if (j->p < j->end && *j->p == ',') { j->p++; continue; }
            if (j->p < j->end && *j->p == close) { j->p++; break; }
            j->bad = 1;
        }
        return n;
    }
    if (c == '"') {
        n->type = J_STR;
        n->str = jstring(j);
        return n;
    }
    if (!strncmp(j->p, "true", 4) || !strncmp(j->p, "false", 5)) {
        n->type = J_BOOL;
        n->num = *j->p == 't';
        j->p += *j->p == 't' ? 4 : 5;
        return n;
    }
    if (!strncmp(j->p, "null", 4)) {
        n->type = J_NULL;
        j->p += 4;
        return n;
    }
    char *stop;
    n->type = J_NUM;
    n->num = strtod(j->p, &stop);
    if (stop == j->p) j->bad = 1;
    j->p = stop;
    return n;
}

/* A whole file into a malloc'ed buffer (*len bytes); NULL when it cannot be read. */
static char *slurp(const char *path, size_t *len, int *missing) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (missing) *missing = fd < 0 && errno == ENOENT;
    if (fd < 0) return NULL;
    size_t cap = 4096, n = 0;
    char *buf = malloc(cap);
    for (;;) {
        if (!buf) { close(fd); return NULL; }
        if (n == cap) {
            cap *= 2;
            char *grown = realloc(buf, cap);
            if (!grown) { free(buf); close(fd); return NULL; }
            buf = grown;
        }
        ssize_t got = read(fd, buf + n, cap - n);
        if (got < 0 && errno == EINTR) continue;
        if (got <= 0) break;
        n += (size_t)got;
    }
    close(fd);
    *len = n;
    return buf;
}

static jnode *jparse(const char *buf, size_t len) {
    jparser j = {buf, buf + len, 0};
    jnode *root = jvalue(&j, 0);
    if (j.bad) { jfree(root); return NULL; }
    return root;
}

/* Parse a whole file; NULL when missing or not valid JSON. */
static jnode *jload(const char *path, int *missing) {
    size_t len = 0;
    char *buf = slurp(path, &len, missing);
    if (!buf) return NULL;
    jnode *root = jparse(buf, len);
    free(buf);
    return root;
}

static jnode *jget(jnode *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (jnode *m = obj->child; m; m = m->next)
        if (m->key && !strcmp(m->key, key)) return m;
    return NULL;
}

static int jtruthy(jnode *n) {
    if (!n) return 0;
    if (n->type == J_BOOL || n->type == J_NUM) return n->num != 0;
    if (n->type == J_STR) return n->str && n->str[0];
    if (n->type == J_ARR || n->type == J_OBJ) return n->child != NULL;
    return 0;
}

/* fake_nvidia_smi._per_gpu: a list gives value[i] (or its last), a scalar is every GPU's. */
static jnode *per_gpu(jnode *v, int i) {
    if (!v || v->type != J_ARR) return v;
    jnode *m = v->child, *last = NULL;
    for (int k = 0; m; k++, m = m->next) {
        if (k == i) return m;
        last = m;
    }
    return last;
}

static jnode *nth(jnode *arr, int i) {
    if (!arr || arr->type != J_ARR) return NULL;
    jnode *m = arr->child;
    while (m && i-- > 0) m = m->next;
    return m;
}

/* --- MD5 (RFC 1321): the default UUIDs are md5("<seed>/<index>") like fake_nvidia_smi._uuid -- */

static void md5(const unsigned char *msg, size_t len, unsigned char out[16]) {
    static const uint32_t K[64] = {
        0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613,
        0xfd469501, 0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193,
        0xa679438e, 0x49b40821, 0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d,
        0x02441453, 0xd8a1e681, 0xe7d3fbc8, 0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed,
        0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a, 0xfffa3942, 0x8771f681, 0x6d9d6122,
        0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70, 0x289b7ec6, 0xeaa127fa,
        0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665, 0xf4292244,
        0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
        0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb,
        0xeb86d391};
    static const unsigned R[64] = {7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22, 7, 12, 17, 22,
                                   5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20, 5, 9,  14, 20,
                                   4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23, 4, 11, 16, 23,
                                   6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21, 6, 10, 15, 21};
    uint32_t h[4] = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
    size_t total = ((len + 8) / 64 + 1) * 64;
    unsigned char *buf = calloc(1, total);
    if (!buf) { memset(out, 0, 16); return; }
    memcpy(buf, msg, len);
    buf[len] = 0x80;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++) buf[total - 8 + i] = (unsigned char)(bits >> (8 * i));
    for (size_t off = 0; off < total; off += 64) {
        uint32_t w[16];
        for (int i = 0; i < 16; i++)
            w[i] = (uint32_t)buf[off + 4 * i] | (uint32_t)buf[off + 4 * i + 1] << 8 |
                   (uint32_t)buf[off + 4 * i + 2] << 16 | (uint32_t)buf[off + 4 * i + 3] << 24;
        uint32_t a = h[0], b = h[1], c = h[2], d = h[3];
        for (int i = 0; i < 64; i++) {
            uint32_t f;
            int g;
            if (i < 16) { f = (b & c) | (~b & d); g = i; }
            else if (i < 32) { f = (d & b) | (~d & c); g = (5 * i + 1) % 16; }
            else if (i < 48) { f = b ^ c ^ d; g = (3 * i + 5) % 16; }
            else { f = c ^ (b | ~d); g = (7 * i) % 16; }
            uint32_t tmp = d;
            d = c;
            c = b;
            uint32_t x = a + f + K[i] + w[g];
            b = b + ((x << R[i]) | (x >> (32 - R[i])));
            a = tmp;
        }
        h[0] += a; h[1] += b; h[2] += c; h[3] += d;
    }
    free(buf);
    for (int i = 0; i < 4; i++)
        for (int k = 0; k < 4; k++) out[4 * i + k] = (unsigned char)(h[i] >> (8 * k));
}

/* --- the configuration (fake_nvidia_smi.DEFAULTS, then config.json) ------------------------- */

#define MAX_GPUS 64
#define MIB 1048576ULL

typedef struct {
    char name[96];
    char uuid[96];
    char bus_id[32];
    int minor;
    long long total, reserved, ghost;
    unsigned util;
    int lost;
    /* health readings (gpufleet health): fake_nvidia_smi.DEFAULTS' keys, the same numbers */
    int persistence, rr_pending, rr_failure, retired; /* retired: -1 = NOT_SUPPORTED */
    unsigned long long ecc_volatile, ecc_aggregate, clocks;
    unsigned rr_correctable, rr_uncorrectable, pcie_gen, pcie_width;
} gpu_cfg;

typedef struct {
    int gpus;
    gpu_cfg gpu[MAX_GPUS];
    char driver[80];
    int cuda; /* "13.0" -> 13000, as cuDriverGetVersion */
    double release_delay_s;
    int hidden_pids, wsl2, fail, hang, mps_server_only;
    long long touch_mib, unlisted_base, unlisted_per_process;
    unsigned temp_c, power_w;
    int init_error; /* nvml_init_error: a lab host with a broken library (README) */
    unsigned pcie_gen_max, pcie_width_max;
} config;

static config g_cfg;
static int g_cfg_valid;
static unsigned g_cfg_gen; /* bumped at every re-parse */
static char g_root[4096];

static const char *root_dir(void) {
    const char *r = getenv("FAKEGPU_ROOT");
    return (r && *r) ? r : "/run/fakegpu";
}

static void copy_str(char *dst, size_t size, jnode *n, const char *dflt) {
    const char *s = (n && n->type == J_STR && n->str) ? n->str : dflt;
    snprintf(dst, size, "%s", s);
}

static long long num_or(jnode *n, long long dflt) {
    return (n && (n->type == J_NUM || n->type == J_BOOL)) ? (long long)n->num : dflt;
}

/* ghost_mib / utilization: {"<index>": value} */
static long long by_index(jnode *obj, int i) {
    char key[16];
    snprintf(key, sizeof key, "%d", i);
    return num_or(jget(obj, key), 0);
}

/* [index, ...] lists the GPU; {"<index>": v} gives it a value; a bare value applies to all */
static int listed(jnode *v, int i) {
    if (!v) return 0;
    if (v->type == J_ARR) {
        for (jnode *m = v->child; m; m = m->next)
            if (m->type == J_NUM && (int)m->num == i) return 1;
        return 0;
    }
    return jtruthy(v);
}

static long long value_for(jnode *v, int i, long long dflt) {
    if (!v || v->type == J_NULL) return dflt;
    if (v->type == J_OBJ) {
        char key[16];
        snprintf(key, sizeof key, "%d", i);
        return num_or(jget(v, key), dflt);
    }
    if (v->type == J_ARR) return listed(v, i);
    return num_or(v, dflt);
}

static void parse_health(jnode *doc, config *c) {
    c->pcie_gen_max = (unsigned)num_or(jget(doc, "pcie_gen_max"), 5);
    c->pcie_width_max = (unsigned)num_or(jget(doc, "pcie_width_max"), 16);
    jnode *retired = jget(doc, "retired_pending");
    for (int i = 0; i < c->gpus; i++) {
        gpu_cfg *g = &c->gpu[i];
        g->persistence = (int)value_for(jget(doc, "persistence"), i, 1);
        g->ecc_volatile = (unsigned long long)value_for(jget(doc, "ecc_volatile"), i, 0);
        g->ecc_aggregate = (unsigned long long)value_for(jget(doc, "ecc_aggregate"), i, 0);
        g->rr_pending = listed(jget(doc, "remapped_pending"), i);
        g->rr_failure = listed(jget(doc, "remapped_failure"), i);
        g->rr_correctable = (unsigned)value_for(jget(doc, "remapped_correctable"), i, 0);
        g->rr_uncorrectable = (unsigned)value_for(jget(doc, "remapped_uncorrectable"), i, 0);
        g->retired = (!retired || retired->type == J_NULL) ? -1 : listed(retired, i);
        g->clocks = (unsigned long long)value_for(jget(doc, "clocks_event_reasons"), i, 0);
        g->pcie_gen = (unsigned)value_for(jget(doc, "pcie_gen"), i, c->pcie_gen_max);
        g->pcie_width = (unsigned)value_for(jget(doc, "pcie_width"), i, c->pcie_width_max);
    }
}

static void parse_config(jnode *doc, config *c) {
    memset(c, 0, sizeof(*c));
    c->gpus = (int)num_or(jget(doc, "gpus"), 1);
    if (c->gpus < 0) c->gpus = 0;
    if (c->gpus > MAX_GPUS) c->gpus = MAX_GPUS;
    jnode *name = jget(doc, "name"), *total = jget(doc, "total_mib");
    jnode *reserved = jget(doc, "reserved_mib"), *uuids = jget(doc, "uuids");
    jnode *buses = jget(doc, "bus_ids"), *minors = jget(doc, "minors");
    jnode *ghost = jget(doc, "ghost_mib"), *util = jget(doc, "utilization");
    jnode *lost = jget(doc, "lost");
    jnode *seed = jget(doc, "seed");
    const char *seed_s = (seed && seed->type == J_STR && seed->str) ? seed->str : "fakegpu";
    for (int i = 0; i < c->gpus; i++) {
        gpu_cfg *g = &c->gpu[i];
        copy_str(g->name, sizeof g->name, per_gpu(name, i), "NVIDIA RTX 6000 Ada Generation");
        g->total = num_or(per_gpu(total, i), 49140);
        g->reserved = num_or(per_gpu(reserved, i), 616);
        if (jtruthy(uuids) && nth(uuids, i)) {
            copy_str(g->uuid, sizeof g->uuid, nth(uuids, i), "");
        } else {
            char msg[512];
            unsigned char d[16];
            char hex[33];
            int n = snprintf(msg, sizeof msg, "%s/%d", seed_s, i);
            md5((const unsigned char *)msg, (size_t)(n < (int)sizeof msg ? n : (int)sizeof msg - 1), d);
            for (int k = 0; k < 16; k++) sprintf(hex + 2 * k, "%02x", d[k]);
            snprintf(g->uuid, sizeof g->uuid, "GPU-%.8s-%.4s-%.4s-%.4s-%.12s", hex, hex + 8,
                     hex + 12, hex + 16, hex + 20);
        }
        if (jtruthy(buses) && nth(buses, i)) {
            copy_str(g->bus_id, sizeof g->bus_id, nth(buses, i), "");
        } else {
            snprintf(g->bus_id, sizeof g->bus_id, "00000000:00:%02X.0", 6 + i);
        }
        g->minor = (jtruthy(minors) && nth(minors, i)) ? (int)num_or(nth(minors, i), i) : i;
        g->ghost = by_index(ghost, i);
        g->util = (unsigned)by_index(util, i);
        if (lost && lost->type == J_ARR) {
            for (jnode *m = lost->child; m; m = m->next)
                if (m->type == J_NUM && (int)m->num == i) g->lost = 1;
        } else {
            g->lost = jtruthy(lost);
        }
    }
    copy_str(c->driver, sizeof c->driver, jget(doc, "driver"), "580.159.04");
    char cuda[32];
    copy_str(cuda, sizeof cuda, jget(doc, "cuda"), "13.0");
    int major = 0, minor = 0;
    sscanf(cuda, "%d.%d", &major, &minor);
    c->cuda = major * 1000 + minor * 10;
    jnode *delay = jget(doc, "release_delay_s");
    c->release_delay_s = (delay && delay->type == J_NUM) ? delay->num : 0.0;
    c->hidden_pids = jtruthy(jget(doc, "hidden_pids"));
    c->mps_server_only = jtruthy(jget(doc, "mps_server_only"));
    c->wsl2 = jtruthy(jget(doc, "wsl2"));
    c->fail = jtruthy(jget(doc, "fail"));
    c->hang = jtruthy(jget(doc, "hang"));
    c->touch_mib = num_or(jget(doc, "touch_mib"), 0);
    c->unlisted_base = num_or(jget(doc, "unlisted_mib_base"), 0);
    c->unlisted_per_process = num_or(jget(doc, "unlisted_mib_per_process"), 0);
    c->temp_c = (unsigned)num_or(jget(doc, "temp_c"), 37);
    c->power_w = (unsigned)num_or(jget(doc, "power_w"), 126);
    c->init_error = (int)num_or(jget(doc, "nvml_init_error"), 0);
    parse_health(doc, c);
}

/* The current configuration. Writers rename a new config.json into place; a call trusts the
 * parsed copy while the file's inode, size and times are unchanged and it was compared with the
 * file less than 1 ms ago, else it reads the text again (re-parsing only when the bytes differ):
 * a query sees every change, an in-place writer's within 1 ms. NULL when unreadable. */
static char *g_cfg_text;
static size_t g_cfg_len;
static struct stat g_cfg_stat;
static double g_cfg_checked = -1;

static double now_s(void);

static int same_stat(const struct stat *a, const struct stat *b) {
    return a->st_ino == b->st_ino && a->st_dev == b->st_dev && a->st_size == b->st_size &&
           a->st_mtim.tv_sec == b->st_mtim.tv_sec && a->st_mtim.tv_nsec == b->st_mtim.tv_nsec &&
           a->st_ctim.tv_sec == b->st_ctim.tv_sec && a->st_ctim.tv_nsec == b->st_ctim.tv_nsec;
}

static const config *load_config(void) {
    char path[4200];
    const char *root = root_dir();
    snprintf(path, sizeof path, "%s/config.json", root);
    struct stat st;
    if (stat(path, &st) != 0) memset(&st, 0, sizeof st);
    double now = now_s();
    int same_root = g_cfg_valid && !strcmp(g_root, root);
    if (same_root && same_stat(&st, &g_cfg_stat) && now - g_cfg_checked >= 0 &&
        now - g_cfg_checked < 0.001)
        return &g_cfg;
    size_t len = 0;
    int missing = 0;
    char *text = slurp(path, &len, &missing);
    if (!text && !missing) return NULL;
    if (!text) { /* no config.json: DEFAULTS */
        text = strdup("{}");
        len = 2;
        if (!text) return NULL;
    }
    if (same_root && len == g_cfg_len && !memcmp(text, g_cfg_text, len)) {
        free(text);
        g_cfg_stat = st;
        g_cfg_checked = now;
        return &g_cfg;
    }
    jnode *doc = jparse(text, len);
    if (!doc) { free(text); return NULL; }
    parse_config(doc, &g_cfg);
    jfree(doc);
    g_cfg_gen++;
    free(g_cfg_text);
    g_cfg_text = text;
    g_cfg_len = len;
    g_cfg_stat = st;
    g_cfg_checked = now;
    snprintf(g_root, sizeof g_root, "%s", root);
    g_cfg_valid = 1;
    return &g_cfg;
}

/* --- holders: fake_nvidia_smi.holders() / snapshot() ---------------------------------------- */

typedef struct {
    unsigned pid;
    int gpu;
    long long mib;
} app;

typedef struct {
    long long used[MAX_GPUS], free[MAX_GPUS];
    app *apps;
    int napps;
} snapshot_t;

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    return (double)ts.tv_sec + ts.tv_nsec / 1e9;
}

/* (state, starttime) of a pid in this PID namespace; 0 when it does not exist. */
/* state, starttime and number of threads of a pid (fields 3, 22 and 20 of proc(5)) */
static int proc_state(long pid, char *state, unsigned long long *start, long *threads) {
    char path[64], buf[1024];
    snprintf(path, sizeof path, "/proc/%ld/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return 0;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0) return 0;
    buf[n] = 0;
    char *p = strrchr(buf, ')');
    if (!p || p[1] != ' ') return 0;
    p += 2;
    *state = *p;
    /* fields after the comm: state is [0], num_threads [17], starttime [19] */
    for (int field = 0; field < 19 && p; field++) {
        p = strchr(p, ' ');
        if (p) p++;
        if (p && field == 16) *threads = strtol(p, NULL, 10);
    }
    if (!p) return 0;
    *start = strtoull(p, NULL, 10);
    return 1;
}

/* The death time first seen, shared with fake_nvidia_smi.py as procs/<pid>.dead (text seconds):
 * the first fake to see the holder dead links a complete file into place, so both agree. */
static int dead_since(const char *dead_path, double delay, double now, double *since) {
    char buf[64];
    int fd = open(dead_path, O_RDONLY | O_CLOEXEC);
    if (fd >= 0) {
        ssize_t n = read(fd, buf, sizeof buf - 1);
        close(fd);
        if (n > 0) {
            buf[n] = 0;
            *since = strtod(buf, NULL);
            return 1;
        }
        *since = now; /* being written by the first fake to see the death: that is now */
        return 1;
    }
    if (delay <= 0) return 0;
    char tmp[4300];
    snprintf(tmp, sizeof tmp, "%s.%d.tmp", dead_path, (int)getpid());
    fd = open(tmp, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0666);
    if (fd < 0) { *since = now; return 1; }
    fchmod(fd, 0666);
    int len = snprintf(buf, sizeof buf, "%.6f\n", now);
    if (write(fd, buf, (size_t)len) != len) { /* best effort, as the smi's */ }
    close(fd);
    if (link(tmp, dead_path) != 0) {
        int err = errno;
        unlink(tmp);
        if (err == EEXIST) return dead_since(dead_path, 0, now, since); /* another fake was first */
        /* a filesystem without hard links (EPERM, EOPNOTSUPP): create it in place; a reader
         * that finds it still empty takes "now" (dead_since's n == 0 case) */
        fd = open(dead_path, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
        if (fd < 0) return errno == EEXIST ? dead_since(dead_path, 0, now, since) : (*since = now, 1);
        fchmod(fd, 0666);
        if (write(fd, buf, (size_t)len) != len) { /* best effort */ }
        close(fd);
    }
    unlink(tmp);
    *since = now;
    return 1;
}

static int cmp_app(const void *a, const void *b) {
    const app *x = a, *y = b;
    if (x->gpu != y->gpu) return x->gpu - y->gpu;
    return x->pid < y->pid ? -1 : x->pid > y->pid;
}

/* One row per (GPU, PID), as the driver lists them: an MPS server's row holds its clients'
 * memory when mps_server_only (fake_nvidia_smi.merge_rows). */
static void merge_rows(snapshot_t *s) {
    if (s->napps < 2) return;
    qsort(s->apps, (size_t)s->napps, sizeof(app), cmp_app);
    int n = 1;
    for (int a = 1; a < s->napps; a++) {
        app *last = &s->apps[n - 1];
        if (s->apps[a].gpu == last->gpu && s->apps[a].pid == last->pid)
            last->mib += s->apps[a].mib;
        else
            s->apps[n++] = s->apps[a];
    }
    s->napps = n;
}

typedef struct {
    int idx;
    long long mib;
} alloc_t;

static int cmp_alloc(const void *a, const void *b) {
    return ((const alloc_t *)a)->idx - ((const alloc_t *)b)->idx;
}

/* One holder record, parsed. Records are written once (renamed into place) and never changed,
 * so a parsed record is reused while the directory entry keeps its name and inode. */
typedef struct {
    char name[64];
    ino_t ino;
    int ok;
    long pid;
    long mps_server; /* an MPS client's server (0: none): its row when mps_server_only */
    unsigned long long starttime;
    int nal, nvis;
    alloc_t al[MAX_GPUS];
    int vis[MAX_GPUS];
} record;

static record *g_recs;
static int g_nrecs;

static int cmp_record(const void *a, const void *b) {
    return strcmp(((const record *)a)->name, ((const record *)b)->name);
}

static void parse_record(const char *path, record *r) {
    jnode *rec = jload(path, NULL);
    r->ok = rec && jget(rec, "pid") && jget(rec, "starttime");
    if (r->ok) {
        r->pid = (long)num_or(jget(rec, "pid"), 0);
        r->starttime = (unsigned long long)num_or(jget(rec, "starttime"), 0);
        r->mps_server = (long)num_or(jget(rec, "mps_server"), 0);
        jnode *alloc = jget(rec, "alloc");
        if (alloc && alloc->type == J_OBJ)
            for (jnode *m = alloc->child; m && r->nal < MAX_GPUS; m = m->next)
                r->al[r->nal++] = (alloc_t){atoi(m->key), num_or(m, 0)};
        qsort(r->al, (size_t)r->nal, sizeof(alloc_t), cmp_alloc);
        jnode *vis = jget(rec, "visible");
        if (vis && vis->type == J_ARR)
            for (jnode *m = vis->child; m && r->nvis < MAX_GPUS; m = m->next)
                r->vis[r->nvis++] = (int)num_or(m, -1);
    }
    jfree(rec);
}

/* The records now in procs/, sorted by name as fake_nvidia_smi's sorted(os.listdir()). */
static record *list_records(const char *pdir, int *count) {
    DIR *d = opendir(pdir);
    int n = 0, cap = 0;
    record *out = NULL;
    if (d) {
        struct dirent *e;
        while ((e = readdir(d))) {
            size_t len = strlen(e->d_name);
            if (len < 6 || len >= sizeof(out->name) || strcmp(e->d_name + len - 5, ".json")) continue;
            if (n == cap) {
                cap = cap ? cap * 2 : 16;
                record *grown = realloc(out, sizeof(record) * (size_t)cap);
                if (!grown) break;
                out = grown;
            }
            record *r = &out[n++];
            memset(r, 0, sizeof(*r) - sizeof(r->al) - sizeof(r->vis));
            memcpy(r->name, e->d_name, len + 1);
            r->ino = e->d_ino;
            r->ok = -1; /* not parsed yet */
        }
        closedir(d);
    }
    if (n) qsort(out, (size_t)n, sizeof(record), cmp_record);
    *count = n;
    return out;
}

/* A snapshot is reused for at most this long by the same process, and only while config.json's
 * text and the procs/ listing (names and inodes) are unchanged: an agent reads memory and
 * processes of every GPU in a burst, and rescanning /proc for each call would cost ~25x more. */
#define SNAPSHOT_TTL_S 0.001

static snapshot_t g_snap;
static double g_snap_time = -1;
static unsigned g_snap_cfg_gen;

static void copy_snapshot(const snapshot_t *from, snapshot_t *to) {
    *to = *from;
    to->apps = NULL;
    if (from->napps) {
        to->apps = malloc(sizeof(app) * (size_t)from->napps);
        if (to->apps) memcpy(to->apps, from->apps, sizeof(app) * (size_t)from->napps);
        else to->napps = 0;
    }
}

static void take(const config *c, snapshot_t *s) {
    char pdir[4200];
    snprintf(pdir, sizeof pdir, "%s/procs", root_dir());
    int nnames = 0;
    record *recs = list_records(pdir, &nnames);
    double now = now_s();
    int same_listing = nnames == g_nrecs;
    for (int k = 0; same_listing && k < nnames; k++)
        same_listing = recs[k].ino == g_recs[k].ino && !strcmp(recs[k].name, g_recs[k].name);
    if (same_listing && g_snap_time >= 0 && g_snap_cfg_gen == g_cfg_gen &&
        now - g_snap_time >= 0 && now - g_snap_time < SNAPSHOT_TTL_S) {
        free(recs);
        copy_snapshot(&g_snap, s);
        return;
    }
    /* reuse parsed records (both lists are sorted by name) */
    for (int k = 0, j = 0; k < nnames; k++) {
        while (j < g_nrecs && strcmp(g_recs[j].name, recs[k].name) < 0) j++;
        if (j < g_nrecs && !strcmp(g_recs[j].name, recs[k].name) && g_recs[j].ino == recs[k].ino)
            recs[k] = g_recs[j];
    }
    memset(s, 0, sizeof(*s));
    for (int i = 0; i < c->gpus; i++) s->used[i] = c->gpu[i].ghost;
    int app_cap = 0, touched[MAX_GPUS] = {0}, allocated[MAX_GPUS] = {0};
    char *counted_live = calloc((size_t)(nnames ? nnames : 1), 1);
    for (int k = 0; k < nnames; k++) {
        record *r = &recs[k];
        char path[4400], dead_path[4400];
        snprintf(path, sizeof path, "%s/%s", pdir, r->name);
        snprintf(dead_path, sizeof dead_path, "%s/%.*s.dead", pdir, (int)(strlen(r->name) - 5), r->name);
        if (r->ok == -1) parse_record(path, r);
        if (!r->ok) continue;
        char state = 0;
        unsigned long long start = 0;
        long threads = 1;
        int exists = proc_state(r->pid, &state, &start, &threads);
        /* a zombie holds nothing, but a zombie leader whose other threads run holds what they
         * hold (recorded on the H200: NVML listed it, probe-1.log part D) */
        int live = exists && ((state != 'Z' && state != 'X') || threads > 1) &&
                   start == r->starttime;
        if (!live) {
            double since = 0;
            int known = dead_since(dead_path, c->release_delay_s, now, &since);
            if (!(known && now - since < c->release_delay_s)) {
                unlink(path);
                unlink(dead_path);
                r->ok = 0;
                r->ino = 0; /* gone: the listing changed */
                continue;
            }
        }
        for (int a = 0; a < r->nal; a++) {
            int idx = r->al[a].idx;
            if (idx < 0 || idx >= c->gpus || !r->al[a].mib) continue;
            s->used[idx] += r->al[a].mib;
            if (live) {
                allocated[idx] = 1;
                if (s->napps == app_cap) {
                    app_cap = app_cap ? app_cap * 2 : 16;
                    app *grown = realloc(s->apps, sizeof(app) * (size_t)app_cap);
                    if (!grown) continue;
                    s->apps = grown;
                }
                long listed = c->mps_server_only && r->mps_server ? r->mps_server : r->pid;
                s->apps[s->napps++] = (app){(unsigned)listed, idx, r->al[a].mib};
            }
        }
        if (counted_live) counted_live[k] = live && r->nal;
    }
    if (c->touch_mib && counted_live) {
        /* fake_nvidia_smi.snapshot's touch_mib (recorded, h200-two-gpus.log) */
        for (int k = 0; k < nnames; k++) {
            if (!counted_live[k]) continue;
            for (int v = 0; v < recs[k].nvis; v++) {
                int idx = recs[k].vis[v];
                if (idx >= 0 && idx < c->gpus && !allocated[idx] && !touched[idx]) {
                    touched[idx] = 1;
                    s->used[idx] += c->touch_mib;
                }
            }
        }
    }
    free(counted_live);
    if (c->unlisted_base || c->unlisted_per_process) {
        int count[MAX_GPUS] = {0};
        for (int a = 0; a < s->napps; a++) count[s->apps[a].gpu]++;
        for (int i = 0; i < c->gpus; i++)
            if (count[i]) s->used[i] += c->unlisted_base + c->unlisted_per_process * count[i];
    }
    for (int i = 0; i < c->gpus; i++) {
        long long room = c->gpu[i].total - c->gpu[i].reserved;
        if (s->used[i] > room) s->used[i] = room;
        s->free[i] = room - s->used[i];
    }
    merge_rows(s); /* after the driver's share, as fake_nvidia_smi.snapshot */
    qsort(s->apps, (size_t)s->napps, sizeof(app), cmp_app);
    if (c->hidden_pids) s->napps = 0; /* container PID namespace: the driver lists none */
    free(g_recs);
    g_recs = recs;
    g_nrecs = nnames;
    free(g_snap.apps);
    copy_snapshot(s, &g_snap);
    g_snap_time = now;
    g_snap_cfg_gen = g_cfg_gen;
}

/* --- library state ---------------------------------------------------------------------------- */

/* One lock over everything above that is shared (the parsed config, the records and snapshot
 * cache, the devices): an NVML client may call from several threads (a poller beside the main
 * thread), a call keeps using the config it loaded, and take() frees the cache it replaces.
 * Every API call holds it from start to return (LOCKED_CALL, released by the cleanup on any
 * return; a call made inside another call counts as the same), except while a hang sleeps. */
static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static __thread int t_depth;

static int lock_call(void) {
    if (t_depth++ == 0) pthread_mutex_lock(&g_lock);
    return 1;
}

static void unlock_call(int *held) {
    (void)held;
    if (--t_depth == 0) pthread_mutex_unlock(&g_lock);
}

#define LOCKED_CALL __attribute__((cleanup(unlock_call), unused)) int locked_call_ = lock_call()

static int g_refcount;
static struct nvmlDevice_st g_devices[MAX_GPUS];

/* hang: the call blocks while config.json says so, like the fake nvidia-smi, but bounded (10 min,
 * then NVML_ERROR_TIMEOUT) and re-checked every 50 ms, so a test can end the hang. */
static nvmlReturn_t current(const config **out) {
    const config *c = load_config();
    for (int waited = 0; c && c->hang; waited += 50) {
        if (waited >= 600000) return NVML_ERROR_TIMEOUT;
        struct timespec ts = {0, 50 * 1000 * 1000};
        if (t_depth) pthread_mutex_unlock(&g_lock); /* other threads' calls see the hang too */
        nanosleep(&ts, NULL);
        if (t_depth) pthread_mutex_lock(&g_lock);
        c = load_config();
    }
    if (!c) return NVML_ERROR_UNKNOWN; /* config.json unreadable */
    *out = c;
    return NVML_SUCCESS;
}

/* Common checks of every device call: initialised, a handle of ours, driver up, GPU present. */
static nvmlReturn_t device_call(nvmlDevice_t device, const config **out) {
    if (g_refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    struct nvmlDevice_st *h = device.handle;
    if (!h || h < g_devices || h >= g_devices + MAX_GPUS) return NVML_ERROR_INVALID_ARGUMENT;
    const config *c;
    nvmlReturn_t rc = current(&c);
    if (rc) return rc;
    if (h->index >= c->gpus) return NVML_ERROR_INVALID_ARGUMENT;
    if (c->fail) return NVML_ERROR_UNKNOWN; /* driver gone after init: "An internal driver error" */
    if (c->gpu[h->index].lost) return NVML_ERROR_GPU_IS_LOST;
    *out = c;
    return NVML_SUCCESS;
}

static nvmlReturn_t put_string(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    size_t need = strlen(src) + 1;
    if (length < need) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, need);
    return NVML_SUCCESS;
}

/* --- the API ------------------------------------------------------------------------------------ */

API nvmlReturn_t nvmlInitWithFlags(unsigned int flags) {
    LOCKED_CALL;
    (void)flags;
    const config *c;
    nvmlReturn_t rc = current(&c);
    if (rc) return rc;
    /* The broken driver: nvml.h nvmlInit_v2 "NVML_ERROR_DRIVER_NOT_LOADED if NVIDIA driver is not
     * running"; nvidia-smi exits with the same code 9 (NVML's return code) and prints "couldn't
     * communicate with the NVIDIA driver" (fake_nvidia_smi.FAIL_TEXT, recorded). */
    if (c->fail) return NVML_ERROR_DRIVER_NOT_LOADED;
    if (c->init_error) return c->init_error;
    for (int i = 0; i < MAX_GPUS; i++) g_devices[i].index = i;
    __atomic_add_fetch(&g_refcount, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlInit_v2(void) { return nvmlInitWithFlags(0); }

API nvmlReturn_t nvmlShutdown(void) {
    LOCKED_CALL;
    if (g_refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    __atomic_sub_fetch(&g_refcount, 1, __ATOMIC_SEQ_CST);
    return NVML_SUCCESS;
}

/* Texts as nvidia-smi and pynvml print them ("Failed to initialize NVML: Driver/library version
 * mismatch", "Driver Not Loaded", "Unknown Error"); unrecorded here except through those. */
API const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case 0: return "Success";
    case 1: return "Uninitialized";
    case 2: return "Invalid Argument";
    case 3: return "Not Supported";
    case 4: return "Insufficient Permissions";
    case 5: return "Already Initialized";
    case 6: return "Not Found";
    case 7: return "Insufficient Size";
    case 8: return "Insufficient External Power";
    case 9: return "Driver Not Loaded";
    case 10: return "Timeout";
    case 11: return "Interrupt request issue";
    case 12: return "NVML Shared Library Not Found";
    case 13: return "Function Not Found";
    case 14: return "Corrupted infoROM";
    case 15: return "GPU is lost";
    case 16: return "GPU requires restart";
    case 17: return "The operating system has blocked the request.";
    case 18: return "Driver/library version mismatch";
    case 19: return "In use by another client";
    case 20: return "Insufficient Memory";
    case 21: return "No data";
    case 25: return "Argument version mismatch";
    default: return "Unknown Error";
    }
}

API nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    LOCKED_CALL;
    if (g_refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    const config *c = load_config();
    if (!c) return NVML_ERROR_UNKNOWN;
    return put_string(version, length, c->driver);
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *cudaDriverVersion) {
    LOCKED_CALL;
    if (!cudaDriverVersion) return NVML_ERROR_INVALID_ARGUMENT;
    const config *c = load_config();
    if (!c) return NVML_ERROR_UNKNOWN;
    *cudaDriverVersion = c->cuda; /* recorded: 13000 for "CUDA Version: 13.0" */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *cudaDriverVersion) {
    LOCKED_CALL;
    return nvmlSystemGetCudaDriverVersion_v2(cudaDriverVersion);
}

API nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *deviceCount) {
    LOCKED_CALL;
    if (g_refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!deviceCount) return NVML_ERROR_INVALID_ARGUMENT;
    const config *c;
    nvmlReturn_t rc = current(&c);
    if (rc) return rc;
    *deviceCount = (unsigned)c->gpus; /* a lost GPU is still counted */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int index, nvmlDevice_t *device) {
    LOCKED_CALL;
    if (g_refcount <= 0) return NVML_ERROR_UNINITIALIZED;
    if (!device) return NVML_ERROR_INVALID_ARGUMENT;
    const config *c;
    nvmlReturn_t rc = current(&c);
    if (rc) return rc;
    if (index >= (unsigned)c->gpus) return NVML_ERROR_INVALID_ARGUMENT;
    /* nvidia-smi on a GPU that fell off the bus: "Unable to determine the device handle for GPU
     * ...: GPU is lost"; nvml.h lists GPU_IS_LOST for this call. */
    if (c->gpu[index].lost) return NVML_ERROR_GPU_IS_LOST;
    device->handle = &g_devices[index];
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    return put_string(uuid, length, c->gpu[device.handle->index].uuid);
}

API nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    return put_string(name, length, c->gpu[device.handle->index].name);
}

API nvmlReturn_t nvmlDeviceGetPciInfo_v3(nvmlDevice_t device, nvmlPciInfo_t *pci) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!pci) return NVML_ERROR_INVALID_ARGUMENT;
    const char *bus_id = c->gpu[device.handle->index].bus_id;
    unsigned domain = 0, bus = 0, dev = 0;
    sscanf(bus_id, "%x:%x:%x", &domain, &bus, &dev);
    memset(pci, 0, sizeof(*pci));
    pci->domain = domain;
    pci->bus = bus;
    pci->device = dev;
    /* nvml.h: NVML_DEVICE_PCI_BUS_ID_LEGACY_FMT "%04X:%02X:%02X.0", NVML_DEVICE_PCI_BUS_ID_FMT
     * "%08X:%02X:%02X.0"; the configured id is what nvidia-smi prints, so it is kept verbatim. */
    snprintf(pci->busIdLegacy, sizeof pci->busIdLegacy, "%04X:%02X:%02X.0", domain & 0xffff, bus,
             dev);
    snprintf(pci->busId, sizeof pci->busId, "%s", bus_id);
    pci->pciDeviceId = 0; /* unrecorded, not modelled */
    pci->pciSubSystemId = 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minorNumber) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!minorNumber) return NVML_ERROR_INVALID_ARGUMENT;
    *minorNumber = (unsigned)c->gpu[device.handle->index].minor;
    return NVML_SUCCESS;
}

/* v1: recorded on the H200 (probe3), used = the reservation + allocations; free as v2. */
API nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    snapshot_t s;
    take(c, &s);
    int i = device.handle->index;
    memory->total = (unsigned long long)c->gpu[i].total * MIB;
    memory->free = (unsigned long long)s.free[i] * MIB;
    memory->used = (unsigned long long)(s.used[i] + c->gpu[i].reserved) * MIB;
    free(s.apps);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!memory) return NVML_ERROR_INVALID_ARGUMENT;
    if (memory->version != nvmlMemory_v2) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    snapshot_t s;
    take(c, &s);
    int i = device.handle->index;
    memory->total = (unsigned long long)c->gpu[i].total * MIB;
    memory->reserved = (unsigned long long)c->gpu[i].reserved * MIB;
    memory->free = (unsigned long long)s.free[i] * MIB;
    memory->used = (unsigned long long)s.used[i] * MIB;
    free(s.apps);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetUtilizationRates(nvmlDevice_t device, nvmlUtilization_t *utilization) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!utilization) return NVML_ERROR_INVALID_ARGUMENT;
    utilization->gpu = c->gpu[device.handle->index].util;
    utilization->memory = 0; /* not modelled by the fake nvidia-smi either */
    return NVML_SUCCESS;
}

/* The process lists: nvml.h nvmlDeviceGetComputeRunningProcesses_v3: "call this function with
 * *infoCount = 0. The return code will be NVML_ERROR_INSUFFICIENT_SIZE, or NVML_SUCCESS if none
 * are running. For this call infos is allowed to be NULL"; on INSUFFICIENT_SIZE "infoCount will
 * contain minimal amount of space necessary". ``size`` picks the struct version. */
static nvmlReturn_t processes(nvmlDevice_t device, unsigned int *infoCount, void *infos, int v1,
                              int graphics) {
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!infoCount) return NVML_ERROR_INVALID_ARGUMENT;
    int i = device.handle->index;
    snapshot_t s;
    unsigned n = 0;
    if (graphics) {
        s.apps = NULL; /* the lab runs no graphics clients */
    } else {
        take(c, &s);
        for (int a = 0; a < s.napps; a++) n += s.apps[a].gpu == i;
    }
    if (*infoCount < n) {
        *infoCount = n;
        free(s.apps);
        return NVML_ERROR_INSUFFICIENT_SIZE;
    }
    if (n && !infos) {
        free(s.apps);
        return NVML_ERROR_INVALID_ARGUMENT;
    }
    unsigned k = 0;
    for (int a = 0; !graphics && a < s.napps; a++) {
        if (s.apps[a].gpu != i) continue;
        unsigned long long used =
            c->wsl2 ? VALUE_NOT_AVAILABLE_ULL : (unsigned long long)s.apps[a].mib * MIB;
        if (v1) {
            nvmlProcessInfo_v1_t *p = (nvmlProcessInfo_v1_t *)infos + k;
            p->pid = s.apps[a].pid;
            p->usedGpuMemory = used;
        } else {
            nvmlProcessInfo_t *p = (nvmlProcessInfo_t *)infos + k;
            p->pid = s.apps[a].pid;
            p->usedGpuMemory = used;
            p->gpuInstanceId = NOT_MIG;
            p->computeInstanceId = NOT_MIG;
        }
        k++;
    }
    *infoCount = n;
    free(s.apps);
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    LOCKED_CALL;
    return processes(device, infoCount, infos, 0, 0);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses_v2(nvmlDevice_t device, unsigned int *infoCount,
                                                         nvmlProcessInfo_t *infos) {
    LOCKED_CALL;
    return processes(device, infoCount, infos, 0, 0);
}

API nvmlReturn_t nvmlDeviceGetComputeRunningProcesses(nvmlDevice_t device, unsigned int *infoCount,
                                                      nvmlProcessInfo_v1_t *infos) {
    LOCKED_CALL;
    return processes(device, infoCount, infos, 1, 0);
}

API nvmlReturn_t nvmlDeviceGetGraphicsRunningProcesses_v3(nvmlDevice_t device, unsigned int *infoCount,
                                                          nvmlProcessInfo_t *infos) {
    LOCKED_CALL;
    return processes(device, infoCount, infos, 0, 1);
}

API nvmlReturn_t nvmlDeviceGetPersistenceMode(nvmlDevice_t device, int *mode) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!mode) return NVML_ERROR_INVALID_ARGUMENT;
    /* recorded rc=0 1 (nvidia-smi says "Enabled"); config "persistence" turns it off */
    *mode = c->gpu[device.handle->index].persistence ? NVML_FEATURE_ENABLED : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTemperature(nvmlDevice_t device, int sensorType, unsigned int *temp) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!temp || sensorType != NVML_TEMPERATURE_GPU) return NVML_ERROR_INVALID_ARGUMENT;
    *temp = c->temp_c;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetPowerUsage(nvmlDevice_t device, unsigned int *power) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!power) return NVML_ERROR_INVALID_ARGUMENT;
    *power = c->power_w * 1000u; /* milliwatts (recorded 128188 while nvidia-smi showed 128W) */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetCurrentClocksEventReasons(nvmlDevice_t device,
                                                        unsigned long long *clocksEventReasons) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!clocksEventReasons) return NVML_ERROR_INVALID_ARGUMENT;
    *clocksEventReasons = c->gpu[device.handle->index].clocks; /* recorded 0x0 */
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetTotalEccErrors(nvmlDevice_t device, int errorType, int counterType,
                                             unsigned long long *eccCounts) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!eccCounts || errorType < 0 || errorType > 1 || counterType < 0 || counterType > 1)
        return NVML_ERROR_INVALID_ARGUMENT;
    /* recorded 0 (uncorrected; volatile and aggregate); corrected errors are not modelled */
    const gpu_cfg *g = &c->gpu[device.handle->index];
    *eccCounts = errorType == 1 ? (counterType == 0 ? g->ecc_volatile : g->ecc_aggregate) : 0;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetRemappedRows(nvmlDevice_t device, unsigned int *corrRows,
                                           unsigned int *uncRows, unsigned int *isPending,
                                           unsigned int *failureOccurred) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!corrRows || !uncRows || !isPending || !failureOccurred) return NVML_ERROR_INVALID_ARGUMENT;
    const gpu_cfg *g = &c->gpu[device.handle->index]; /* recorded all 0 */
    *corrRows = g->rr_correctable;
    *uncRows = g->rr_uncorrectable;
    *isPending = (unsigned)g->rr_pending;
    *failureOccurred = (unsigned)g->rr_failure;
    return NVML_SUCCESS;
}

API nvmlReturn_t nvmlDeviceGetRetiredPagesPendingStatus(nvmlDevice_t device, int *isPending) {
    LOCKED_CALL;
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    const gpu_cfg *g = &c->gpu[device.handle->index];
    if (g->retired < 0) return NVML_ERROR_NOT_SUPPORTED; /* recorded on the H200: rc=3 */
    if (!isPending) return NVML_ERROR_INVALID_ARGUMENT;
    *isPending = g->retired;
    return NVML_SUCCESS;
}

/* which: 0 current gen, 1 current width, 2 max gen, 3 max width */
static nvmlReturn_t pcie(nvmlDevice_t device, unsigned int *out, int which) {
    const config *c;
    nvmlReturn_t rc = device_call(device, &c);
    if (rc) return rc;
    if (!out) return NVML_ERROR_INVALID_ARGUMENT;
    const gpu_cfg *g = &c->gpu[device.handle->index];
    unsigned values[4] = {g->pcie_gen, g->pcie_width, c->pcie_gen_max, c->pcie_width_max};
    *out = values[which];
    return NVML_SUCCESS;
}

/* recorded on the H200: current and max generation 5, width 16 (the defaults) */
API nvmlReturn_t nvmlDeviceGetCurrPcieLinkGeneration(nvmlDevice_t device, unsigned int *currLinkGen) {
    LOCKED_CALL;
    return pcie(device, currLinkGen, 0);
}
API nvmlReturn_t nvmlDeviceGetCurrPcieLinkWidth(nvmlDevice_t device, unsigned int *currLinkWidth) {
    LOCKED_CALL;
    return pcie(device, currLinkWidth, 1);
}
API nvmlReturn_t nvmlDeviceGetMaxPcieLinkGeneration(nvmlDevice_t device, unsigned int *maxLinkGen) {
    LOCKED_CALL;
    return pcie(device, maxLinkGen, 2);
}
API nvmlReturn_t nvmlDeviceGetMaxPcieLinkWidth(nvmlDevice_t device, unsigned int *maxLinkWidth) {
    LOCKED_CALL;
    return pcie(device, maxLinkWidth, 3);
}
