/*
 * A fake libnvidia-ml.so.1 for tests, compiled against NVIDIA's own nvml.h.
 *
 * The real, unmodified pynvml loads it with CDLL("libnvidia-ml.so.1"). Its GPUs, their
 * processes (by host pid) and injected errors come from the JSON file named by the
 * environment variable FAKE_NVML_STATE. The file is re-read whenever it changes (writers
 * replace it atomically with rename), so a test can change GPU usage while the process
 * under test runs. See README.md beside this file for the format.
 *
 * Only what vram-enforcer uses is implemented, but it follows the NVML contract where it
 * matters: init refcounting, UNINITIALIZED before init, the INSUFFICIENT_SIZE handshake of
 * the process lists, NVML_VALUE_NOT_AVAILABLE, stable device handles, MIG handles.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <sys/time.h>
#include <time.h>
#include <unistd.h>

#define NVML_NO_UNVERSIONED_FUNC_DEFS
#include <nvml.h>

#define MAX_GPUS 16
#define MAX_MIGS 8
#define MAX_MIG_SLOTS 7 /* what nvmlDeviceGetMaxMigDeviceCount reports on an H100 */
#define CGROUP2_MAGIC 0x63677270
#define FIRST_LIMITS_DRIVER 615 /* nvmlDeviceSetMemoryLimits_v1 came with R615 (CUDA 13.4) */
#define DEFAULT_RESERVED (512ULL << 20) /* a GPU's driver-reserved memory unless the state says */
#define MAX_ANCESTORS 32

/* ---------------------------------------------------------------- a small JSON parser */

typedef enum { J_NULL, J_BOOL, J_NUM, J_STR, J_ARR, J_OBJ } jtype;

typedef struct jv {
    jtype type;
    int boolean;
    int negative;       /* J_NUM: a leading minus */
    int integral;       /* J_NUM: no fraction or exponent */
    unsigned long long u; /* J_NUM: the magnitude, exact for integers up to 2^64-1 */
    double d;           /* J_NUM: the value as a double */
    char *str;          /* J_STR */
    char **keys;        /* J_OBJ */
    struct jv **items;  /* J_ARR, J_OBJ */
    size_t n;
} jv;

typedef struct {
    const char *p, *end;
    const char *err;
} jparser;

static void jfree(jv *v) {
    if (!v) return;
    free(v->str);
    for (size_t i = 0; i < v->n; i++) {
        if (v->keys) free(v->keys[i]);
        jfree(v->items[i]);
    }
    free(v->keys);
    free(v->items);
    free(v);
}

static void skip_ws(jparser *ps) {
    while (ps->p < ps->end && (*ps->p == ' ' || *ps->p == '\t' || *ps->p == '\n' || *ps->p == '\r'))
        ps->p++;
}

static jv *jnew(jtype t) {
    jv *v = calloc(1, sizeof(jv));
    if (v) v->type = t;
    return v;
}

static int push(jv *v, char *key, jv *item) {
    jv **items = realloc(v->items, (v->n + 1) * sizeof(jv *));
    if (!items) return 0;
    v->items = items;
    if (v->type == J_OBJ) {
        char **keys = realloc(v->keys, (v->n + 1) * sizeof(char *));
        if (!keys) return 0;
        v->keys = keys;
        v->keys[v->n] = key;
    }
    v->items[v->n++] = item;
    return 1;
}

static void put_utf8(char *out, size_t *len, unsigned cp) {
    if (cp < 0x80) {
        out[(*len)++] = (char)cp;
    } else if (cp < 0x800) {
        out[(*len)++] = (char)(0xC0 | (cp >> 6));
        out[(*len)++] = (char)(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out[(*len)++] = (char)(0xE0 | (cp >> 12));
        out[(*len)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*len)++] = (char)(0x80 | (cp & 0x3F));
    } else {
        out[(*len)++] = (char)(0xF0 | (cp >> 18));
        out[(*len)++] = (char)(0x80 | ((cp >> 12) & 0x3F));
        out[(*len)++] = (char)(0x80 | ((cp >> 6) & 0x3F));
        out[(*len)++] = (char)(0x80 | (cp & 0x3F));
    }
}

static int hex4(const char *p, unsigned *out) {
    unsigned v = 0;
    for (int i = 0; i < 4; i++) {
        char c = p[i];
        v <<= 4;
        if (c >= '0' && c <= '9') v |= (unsigned)(c - '0');
        else if (c >= 'a' && c <= 'f') v |= (unsigned)(c - 'a' + 10);
        else if (c >= 'A' && c <= 'F') v |= (unsigned)(c - 'A' + 10);
        else return 0;
    }
    *out = v;
    return 1;
}

static char *parse_string(jparser *ps) {
    /* ps->p is at the opening quote. Escapes only shrink, so the raw length bounds the output. */
    const char *start = ++ps->p;
    while (ps->p < ps->end && *ps->p != '"') ps->p += (*ps->p == '\\') ? 2 : 1;
    if (ps->p >= ps->end) { ps->err = "unterminated string"; return NULL; }
    size_t raw = (size_t)(ps->p - start);
    char *out = malloc(raw + 4);
    if (!out) { ps->err = "out of memory"; return NULL; }
    size_t len = 0;
    for (const char *q = start; q < ps->p; q++) {
        if (*q != '\\') { out[len++] = *q; continue; }
        q++;
        switch (*q) {
        case '"': out[len++] = '"'; break;
        case '\\': out[len++] = '\\'; break;
        case '/': out[len++] = '/'; break;
        case 'b': out[len++] = '\b'; break;
        case 'f': out[len++] = '\f'; break;
        case 'n': out[len++] = '\n'; break;
        case 'r': out[len++] = '\r'; break;
        case 't': out[len++] = '\t'; break;
        case 'u': {
            unsigned cp;
            if (ps->p - q < 5 || !hex4(q + 1, &cp)) { free(out); ps->err = "bad \\u escape"; return NULL; }
            q += 4;
            /* A surrogate pair is two escapes; both fit in the 12 raw bytes they came from. */
            if (cp >= 0xD800 && cp < 0xDC00 && ps->p - q >= 7 && q[1] == '\\' && q[2] == 'u') {
                unsigned lo;
                if (hex4(q + 3, &lo) && lo >= 0xDC00 && lo < 0xE000) {
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                    q += 6;
                }
            }
            put_utf8(out, &len, cp);
            break;
        }
        default: free(out); ps->err = "bad escape"; return NULL;
        }
    }
    out[len] = '\0';
    ps->p++; /* closing quote */
    return out;
}

static jv *parse_value(jparser *ps, int depth);

static jv *parse_number(jparser *ps) {
    jv *v = jnew(J_NUM);
    if (!v) { ps->err = "out of memory"; return NULL; }
    const char *start = ps->p;
    if (*ps->p == '-') { v->negative = 1; ps->p++; }
    if (ps->p >= ps->end || *ps->p < '0' || *ps->p > '9') { free(v); ps->err = "bad number"; return NULL; }
    v->integral = 1;
    int overflow = 0;
    while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') {
        unsigned digit = (unsigned)(*ps->p - '0');
        if (v->u > (ULLONG_MAX - digit) / 10) overflow = 1;
        else v->u = v->u * 10 + digit;
        ps->p++;
    }
    if (ps->p < ps->end && (*ps->p == '.' || *ps->p == 'e' || *ps->p == 'E')) {
        v->integral = 0;
        if (*ps->p == '.') { ps->p++; while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') ps->p++; }
        if (ps->p < ps->end && (*ps->p == 'e' || *ps->p == 'E')) {
            ps->p++;
            if (ps->p < ps->end && (*ps->p == '+' || *ps->p == '-')) ps->p++;
            while (ps->p < ps->end && *ps->p >= '0' && *ps->p <= '9') ps->p++;
        }
    }
    if (overflow) v->integral = 0;
    char buf[64];
    size_t n = (size_t)(ps->p - start);
    if (n >= sizeof buf) n = sizeof buf - 1;
    memcpy(buf, start, n);
    buf[n] = '\0';
    v->d = strtod(buf, NULL);
    return v;
}

static int match_word(jparser *ps, const char *word) {
    size_t n = strlen(word);
    if ((size_t)(ps->end - ps->p) < n || memcmp(ps->p, word, n) != 0) return 0;
    ps->p += n;
    return 1;
}

static jv *parse_container(jparser *ps, int depth, jtype type) {
    char close = type == J_ARR ? ']' : '}';
    jv *v = jnew(type);
    if (!v) { ps->err = "out of memory"; return NULL; }
    ps->p++;
    skip_ws(ps);
    if (ps->p < ps->end && *ps->p == close) { ps->p++; return v; }
    for (;;) {
        char *key = NULL;
        skip_ws(ps);
        if (type == J_OBJ) {
            if (ps->p >= ps->end || *ps->p != '"') { ps->err = "expected a key"; jfree(v); return NULL; }
            key = parse_string(ps);
            if (!key) { jfree(v); return NULL; }
            skip_ws(ps);
            if (ps->p >= ps->end || *ps->p != ':') { ps->err = "expected ':'"; free(key); jfree(v); return NULL; }
            ps->p++;
        }
        jv *item = parse_value(ps, depth + 1);
        if (!item || !push(v, key, item)) {
            if (item) jfree(item);
            free(key);
            if (!ps->err) ps->err = "out of memory";
            jfree(v);
            return NULL;
        }
        skip_ws(ps);
        if (ps->p < ps->end && *ps->p == ',') { ps->p++; continue; }
        if (ps->p < ps->end && *ps->p == close) { ps->p++; return v; }
        ps->err = type == J_ARR ? "expected ',' or ']'" : "expected ',' or '}'";
        jfree(v);
        return NULL;
    }
}

static jv *parse_value(jparser *ps, int depth) {
    if (depth > 64) { ps->err = "nested too deeply"; return NULL; }
    skip_ws(ps);
    if (ps->p >= ps->end) { ps->err = "unexpected end"; return NULL; }
    char c = *ps->p;
    if (c == '{') return parse_container(ps, depth, J_OBJ);
    if (c == '[') return parse_container(ps, depth, J_ARR);
    if (c == '"') {
        jv *v = jnew(J_STR);
        if (!v) { ps->err = "out of memory"; return NULL; }
        v->str = parse_string(ps);
        if (!v->str) { free(v); return NULL; }
        return v;
    }
    if (c == '-' || (c >= '0' && c <= '9')) return parse_number(ps);
    if (match_word(ps, "null")) return jnew(J_NULL);
    if (match_word(ps, "true")) { jv *v = jnew(J_BOOL); if (v) v->boolean = 1; return v; }
    if (match_word(ps, "false")) return jnew(J_BOOL);
    ps->err = "unexpected character";
    return NULL;
}

static const jv *jget(const jv *obj, const char *key) {
    if (!obj || obj->type != J_OBJ) return NULL;
    for (size_t i = 0; i < obj->n; i++)
        if (strcmp(obj->keys[i], key) == 0) return obj->items[i];
    return NULL;
}

static unsigned long long jget_u64(const jv *obj, const char *key, unsigned long long dflt) {
    const jv *v = jget(obj, key);
    if (!v || v->type != J_NUM || v->negative) return dflt;
    return v->integral ? v->u : (unsigned long long)v->d;
}

static void jget_str(const jv *obj, const char *key, char *out, size_t size, const char *dflt) {
    const jv *v = jget(obj, key);
    snprintf(out, size, "%s", (v && v->type == J_STR) ? v->str : dflt);
}

/* ---------------------------------------------------------------- the fake's state */

typedef struct {
    unsigned int pid;
    unsigned long long used; /* NVML_VALUE_NOT_AVAILABLE for JSON null */
    unsigned long long managed; /* of `used`, cudaMallocManaged memory: no cgroup is charged for it */
    unsigned int sm_util, mem_util; /* percent of the GPU in the last sample period */
} fproc;

typedef struct {
    char function[96];
    nvmlReturn_t code;
} ferror_t;

typedef struct fdev {
    char uuid[NVML_DEVICE_UUID_V2_BUFFER_SIZE];
    char name[NVML_DEVICE_NAME_V2_BUFFER_SIZE];
    unsigned long long total, used;
    unsigned long long reserved; /* set aside by the driver and firmware: never allocatable */
    unsigned int minor;
    unsigned int gpu_instance_id, compute_instance_id; /* 0xFFFFFFFF unless a MIG device */
    int is_mig;
    int has_mig;           /* a "mig" object is present: MIG is supported */
    unsigned int mig_mode;
    int nmigs;
    struct fdev *migs;
    fproc *compute, *graphics;
    int ncompute, ngraphics;
    ferror_t *errors;
    int nerrors;
    unsigned long long util_timestamp; /* fixed sample time (us); 0: the time of the call */
} fdev;

typedef struct {
    char driver_version[NVML_SYSTEM_DRIVER_VERSION_BUFFER_SIZE];
    char nvml_version[NVML_SYSTEM_NVML_VERSION_BUFFER_SIZE];
    int cuda_driver_version;
    nvmlReturn_t init_error;
    unsigned int query_delay_ms;
    int limits_charge; /* 0: a limit is held but no process's memory is charged to it */
    int limits_misc;   /* the driver's misc backend (no dmem controller): limits do not nest */
    char **no_dmem_below; /* cgroups whose cgroup.subtree_control lacks dmem */
    int nno_dmem_below;
    ferror_t *errors;
    int nerrors;
    fdev *devs;
    int ndevs;
} fstate;

/* Handles are addresses in these arrays: stable for the life of the process. */
typedef struct {
    int gpu, mig; /* mig = -1 for a whole GPU */
} fhandle;

static fhandle g_gpu_handles[MAX_GPUS];
static fhandle g_mig_handles[MAX_GPUS][MAX_MIGS];

static pthread_mutex_t g_lock = PTHREAD_MUTEX_INITIALIZER;
static fstate *g_state;
static int g_state_ok;          /* the last load succeeded */
static nvmlReturn_t g_load_error; /* why it did not */
static struct stat g_stat;      /* identity of the file g_state came from */
static int g_refcount;

static const struct { const char *name; nvmlReturn_t code; } ERRORS[] = {
    {"SUCCESS", NVML_SUCCESS},
    {"UNINITIALIZED", NVML_ERROR_UNINITIALIZED},
    {"INVALID_ARGUMENT", NVML_ERROR_INVALID_ARGUMENT},
    {"NOT_SUPPORTED", NVML_ERROR_NOT_SUPPORTED},
    {"NO_PERMISSION", NVML_ERROR_NO_PERMISSION},
    {"ALREADY_INITIALIZED", NVML_ERROR_ALREADY_INITIALIZED},
    {"NOT_FOUND", NVML_ERROR_NOT_FOUND},
    {"INSUFFICIENT_SIZE", NVML_ERROR_INSUFFICIENT_SIZE},
    {"INSUFFICIENT_POWER", NVML_ERROR_INSUFFICIENT_POWER},
    {"DRIVER_NOT_LOADED", NVML_ERROR_DRIVER_NOT_LOADED},
    {"TIMEOUT", NVML_ERROR_TIMEOUT},
    {"IRQ_ISSUE", NVML_ERROR_IRQ_ISSUE},
    {"LIBRARY_NOT_FOUND", NVML_ERROR_LIBRARY_NOT_FOUND},
    {"FUNCTION_NOT_FOUND", NVML_ERROR_FUNCTION_NOT_FOUND},
    {"CORRUPTED_INFOROM", NVML_ERROR_CORRUPTED_INFOROM},
    {"GPU_IS_LOST", NVML_ERROR_GPU_IS_LOST},
    {"RESET_REQUIRED", NVML_ERROR_RESET_REQUIRED},
    {"OPERATING_SYSTEM", NVML_ERROR_OPERATING_SYSTEM},
    {"LIB_RM_VERSION_MISMATCH", NVML_ERROR_LIB_RM_VERSION_MISMATCH},
    {"IN_USE", NVML_ERROR_IN_USE},
    {"MEMORY", NVML_ERROR_MEMORY},
    {"NO_DATA", NVML_ERROR_NO_DATA},
    {"NOT_READY", NVML_ERROR_NOT_READY},
    {"GPU_NOT_FOUND", NVML_ERROR_GPU_NOT_FOUND},
    {"INVALID_STATE", NVML_ERROR_INVALID_STATE},
    {"UNKNOWN", NVML_ERROR_UNKNOWN},
};

static nvmlReturn_t error_code(const char *name) {
    for (size_t i = 0; i < sizeof ERRORS / sizeof ERRORS[0]; i++)
        if (strcmp(ERRORS[i].name, name) == 0) return ERRORS[i].code;
    return NVML_ERROR_UNKNOWN;
}

static void free_dev(fdev *d) {
    for (int i = 0; i < d->nmigs; i++) free_dev(&d->migs[i]);
    free(d->migs);
    free(d->compute);
    free(d->graphics);
    free(d->errors);
}

static void free_state(fstate *s) {
    if (!s) return;
    for (int i = 0; i < s->ndevs; i++) free_dev(&s->devs[i]);
    free(s->devs);
    free(s->errors);
    for (int i = 0; i < s->nno_dmem_below; i++) free(s->no_dmem_below[i]);
    free(s->no_dmem_below);
    free(s);
}

static int load_errors(const jv *obj, ferror_t **out, int *n) {
    *out = NULL;
    *n = 0;
    if (!obj || obj->type != J_OBJ || obj->n == 0) return 1;
    *out = calloc(obj->n, sizeof(ferror_t));
    if (!*out) return 0;
    for (size_t i = 0; i < obj->n; i++) {
        const jv *v = obj->items[i];
        if (v->type != J_STR) continue;
        snprintf((*out)[*n].function, sizeof((*out)[*n].function), "%s", obj->keys[i]);
        (*out)[*n].code = error_code(v->str);
        (*n)++;
    }
    return 1;
}

static int load_procs(const jv *arr, fproc **out, int *n) {
    *out = NULL;
    *n = 0;
    if (!arr || arr->type != J_ARR || arr->n == 0) return 1;
    *out = calloc(arr->n, sizeof(fproc));
    if (!*out) return 0;
    for (size_t i = 0; i < arr->n; i++) {
        const jv *p = arr->items[i];
        const jv *used = jget(p, "used_bytes");
        (*out)[*n].pid = (unsigned int)jget_u64(p, "pid", 0);
        (*out)[*n].used = (!used || used->type == J_NULL) ? (unsigned long long)NVML_VALUE_NOT_AVAILABLE
                                                          : jget_u64(p, "used_bytes", 0);
        (*out)[*n].managed = jget_u64(p, "managed_bytes", 0);
        (*out)[*n].sm_util = (unsigned int)jget_u64(p, "sm_util", 0);
        (*out)[*n].mem_util = (unsigned int)jget_u64(p, "mem_util", 0);
        (*n)++;
    }
    return 1;
}

static int load_dev(const jv *obj, fdev *d, int index, int is_mig) {
    char dflt_uuid[64], dflt_name[64];
    snprintf(dflt_uuid, sizeof dflt_uuid, "GPU-00000000-0000-0000-0000-%012d", index);
    snprintf(dflt_name, sizeof dflt_name, "NVIDIA Fake GPU");
    jget_str(obj, "uuid", d->uuid, sizeof d->uuid, dflt_uuid);
    jget_str(obj, "name", d->name, sizeof d->name, dflt_name);
    d->total = jget_u64(obj, "total_bytes", 80ULL << 30);
    d->used = jget_u64(obj, "used_bytes", 0);
    d->reserved = jget_u64(obj, "reserved_bytes", is_mig ? 0 : DEFAULT_RESERVED);
    d->minor = (unsigned int)jget_u64(obj, "minor_number", (unsigned long long)index);
    d->util_timestamp = jget_u64(obj, "utilization_timestamp_us", 0);
    d->is_mig = is_mig;
    d->gpu_instance_id = is_mig ? (unsigned int)jget_u64(obj, "gpu_instance_id", 0) : 0xFFFFFFFFu;
    d->compute_instance_id = is_mig ? (unsigned int)jget_u64(obj, "compute_instance_id", 0) : 0xFFFFFFFFu;
    if (!load_procs(jget(obj, "compute_processes"), &d->compute, &d->ncompute)) return 0;
    if (!load_procs(jget(obj, "graphics_processes"), &d->graphics, &d->ngraphics)) return 0;
    if (!load_errors(jget(obj, "errors"), &d->errors, &d->nerrors)) return 0;
    const jv *mig = is_mig ? NULL : jget(obj, "mig");
    if (mig && mig->type == J_OBJ) {
        d->has_mig = 1;
        d->mig_mode = (unsigned int)jget_u64(mig, "mode", 0);
        const jv *devs = jget(mig, "devices");
        if (devs && devs->type == J_ARR && devs->n > 0) {
            size_t n = devs->n < MAX_MIGS ? devs->n : MAX_MIGS;
            d->migs = calloc(n, sizeof(fdev));
            if (!d->migs) return 0;
            for (size_t i = 0; i < n; i++) {
                d->nmigs++;
                if (!load_dev(devs->items[i], &d->migs[i], (int)i, 1)) return 0;
            }
        }
    }
    return 1;
}

static fstate *build_state(const jv *root) {
    fstate *s = calloc(1, sizeof(fstate));
    if (!s) return NULL;
    jget_str(root, "driver_version", s->driver_version, sizeof s->driver_version, "550.54.15");
    jget_str(root, "nvml_version", s->nvml_version, sizeof s->nvml_version, "12.550.54.15");
    s->cuda_driver_version = (int)jget_u64(root, "cuda_driver_version", 12040);
    const jv *ie = jget(root, "init_error");
    s->init_error = (ie && ie->type == J_STR) ? error_code(ie->str) : NVML_SUCCESS;
    s->query_delay_ms = (unsigned int)jget_u64(root, "query_delay_ms", 0);
    s->limits_charge = (int)jget_u64(root, "limits_charge", 1);
    char backend[16];
    jget_str(root, "limits_backend", backend, sizeof backend, "dmem");
    s->limits_misc = strcmp(backend, "misc") == 0;
    const jv *off = jget(root, "subtree_without_dmem");
    if (off && off->type == J_ARR && off->n > 0) {
        s->no_dmem_below = calloc(off->n, sizeof(char *));
        if (!s->no_dmem_below) { free_state(s); return NULL; }
        for (size_t i = 0; i < off->n; i++) {
            if (off->items[i]->type != J_STR) continue;
            if (!(s->no_dmem_below[s->nno_dmem_below] = strdup(off->items[i]->str))) { free_state(s); return NULL; }
            s->nno_dmem_below++;
        }
    }
    if (!load_errors(jget(root, "errors"), &s->errors, &s->nerrors)) { free_state(s); return NULL; }
    const jv *devs = jget(root, "devices");
    if (devs && devs->type == J_ARR && devs->n > 0) {
        size_t n = devs->n < MAX_GPUS ? devs->n : MAX_GPUS;
        s->devs = calloc(n, sizeof(fdev));
        if (!s->devs) { free_state(s); return NULL; }
        for (size_t i = 0; i < n; i++) {
            s->ndevs++;
            if (!load_dev(devs->items[i], &s->devs[i], (int)i, 0)) { free_state(s); return NULL; }
        }
    }
    return s;
}

/* Re-read the state file if it changed. Called with g_lock held. */
static void refresh(void) {
    const char *path = getenv("FAKE_NVML_STATE");
    struct stat st;
    if (!path || stat(path, &st) != 0) {
        g_state_ok = 0;
        g_load_error = NVML_ERROR_DRIVER_NOT_LOADED;
        memset(&g_stat, 0, sizeof g_stat);
        return;
    }
    if (g_state && st.st_dev == g_stat.st_dev && st.st_ino == g_stat.st_ino && st.st_size == g_stat.st_size &&
        st.st_mtim.tv_sec == g_stat.st_mtim.tv_sec && st.st_mtim.tv_nsec == g_stat.st_mtim.tv_nsec) {
        return; /* unchanged: keep the parsed state and its verdict */
    }
    g_stat = st;
    FILE *f = fopen(path, "rb");
    if (!f) { g_state_ok = 0; g_load_error = NVML_ERROR_DRIVER_NOT_LOADED; return; }
    size_t size = (size_t)st.st_size;
    char *buf = malloc(size + 1);
    size_t got = buf ? fread(buf, 1, size, f) : 0;
    fclose(f);
    if (!buf || got != size) {
        free(buf);
        g_state_ok = 0;
        g_load_error = NVML_ERROR_UNKNOWN;
        return;
    }
    jparser ps = {buf, buf + size, NULL};
    jv *root = parse_value(&ps, 0);
    skip_ws(&ps);
    if (root && ps.p != ps.end) ps.err = "trailing characters";
    fstate *next = NULL;
    if (root && !ps.err) {
        if (root->type != J_OBJ) ps.err = "the top level is not an object";
        else next = build_state(root);
    }
    if (!next) {
        fprintf(stderr, "fake-nvml: cannot use %s: %s at byte %ld\n", path,
                ps.err ? ps.err : "out of memory", (long)(ps.p - buf));
        g_state_ok = 0;
        g_load_error = NVML_ERROR_UNKNOWN;
    } else {
        free_state(g_state);
        g_state = next;
        g_state_ok = 1;
    }
    jfree(root);
    free(buf);
}

static nvmlReturn_t injected(const ferror_t *errors, int n, const char *function) {
    for (int i = 0; i < n; i++)
        if (strcmp(errors[i].function, function) == 0 || strcmp(errors[i].function, "*") == 0)
            return errors[i].code;
    return NVML_SUCCESS;
}

/* Every call but init/shutdown/errorString starts here: lock, refresh, check init and the
 * injected errors. On success the lock stays held and the caller must call leave(). */
static nvmlReturn_t enter(const char *function) {
    pthread_mutex_lock(&g_lock);
    if (g_refcount == 0) { pthread_mutex_unlock(&g_lock); return NVML_ERROR_UNINITIALIZED; }
    refresh();
    nvmlReturn_t r = g_state_ok ? injected(g_state->errors, g_state->nerrors, function) : g_load_error;
    if (r != NVML_SUCCESS) pthread_mutex_unlock(&g_lock);
    return r;
}

static nvmlReturn_t leave(nvmlReturn_t r) {
    pthread_mutex_unlock(&g_lock);
    return r;
}

/* The device behind a handle, or an error; checks the device's injected errors. */
static nvmlReturn_t resolve(nvmlDevice_t device, const char *function, fdev **out) {
    const fhandle *h = (const fhandle *)device;
    if (!h) return NVML_ERROR_INVALID_ARGUMENT;
    int ok_gpu = h >= &g_gpu_handles[0] && h < &g_gpu_handles[MAX_GPUS];
    int ok_mig = h >= &g_mig_handles[0][0] && h < &g_mig_handles[MAX_GPUS - 1][MAX_MIGS];
    if (!ok_gpu && !ok_mig) return NVML_ERROR_INVALID_ARGUMENT;
    if (h->gpu >= g_state->ndevs) return NVML_ERROR_GPU_IS_LOST;
    fdev *d = &g_state->devs[h->gpu];
    if (h->mig >= 0) {
        if (h->mig >= d->nmigs || !d->mig_mode) return NVML_ERROR_INVALID_ARGUMENT;
        nvmlReturn_t parent = injected(d->errors, d->nerrors, function);
        if (parent != NVML_SUCCESS) return parent;
        d = &d->migs[h->mig];
    }
    nvmlReturn_t r = injected(d->errors, d->nerrors, function);
    if (r != NVML_SUCCESS) return r;
    *out = d;
    return NVML_SUCCESS;
}

static nvmlReturn_t copy_string(char *dst, unsigned int length, const char *src) {
    if (!dst) return NVML_ERROR_INVALID_ARGUMENT;
    if (strlen(src) + 1 > length) return NVML_ERROR_INSUFFICIENT_SIZE;
    memcpy(dst, src, strlen(src) + 1);
    return NVML_SUCCESS;
}

/* ---------------------------------------------------------------- init and errors */

/* The real library starts a thread in nvmlInit (seen with driver 580: "cuda00001800007"),
 * with the caller's signal mask. So does the fake: a caller that blocks signals for
 * sigwait only after init loses them to that thread, here as on a GPU node. */
static void *driver_thread(void *arg) {
    (void)arg;
    for (;;) pause();
    return NULL;
}

static void start_driver_thread(void) {
    static int started;
    if (started) return;
    pthread_t t;
    if (pthread_create(&t, NULL, driver_thread, NULL) == 0) {
        pthread_setname_np(t, "fakenvml-drv");
        pthread_detach(t);
        started = 1;
    }
}

static nvmlReturn_t do_init(void) {
    pthread_mutex_lock(&g_lock);
    refresh();
    nvmlReturn_t r = g_state_ok ? g_state->init_error : g_load_error;
    if (r == NVML_SUCCESS) {
        g_refcount++;
        start_driver_thread();
    }
    pthread_mutex_unlock(&g_lock);
    return r;
}

nvmlReturn_t nvmlInit_v2(void) { return do_init(); }
nvmlReturn_t nvmlInit(void) { return do_init(); }
nvmlReturn_t nvmlInitWithFlags(unsigned int flags) { (void)flags; return do_init(); }

nvmlReturn_t nvmlShutdown(void) {
    pthread_mutex_lock(&g_lock);
    nvmlReturn_t r = NVML_SUCCESS;
    if (g_refcount == 0) r = NVML_ERROR_UNINITIALIZED;
    else g_refcount--;
    pthread_mutex_unlock(&g_lock);
    return r;
}

const char *nvmlErrorString(nvmlReturn_t result) {
    switch (result) {
    case NVML_SUCCESS: return "Success";
    case NVML_ERROR_UNINITIALIZED: return "Uninitialized";
    case NVML_ERROR_INVALID_ARGUMENT: return "Invalid Argument";
    case NVML_ERROR_NOT_SUPPORTED: return "Not Supported";
    case NVML_ERROR_NO_PERMISSION: return "Insufficient Permissions";
    case NVML_ERROR_ALREADY_INITIALIZED: return "Already Initialized";
    case NVML_ERROR_NOT_FOUND: return "Not Found";
    case NVML_ERROR_INSUFFICIENT_SIZE: return "Insufficient Size";
    case NVML_ERROR_INSUFFICIENT_POWER: return "Insufficient External Power";
    case NVML_ERROR_DRIVER_NOT_LOADED: return "Driver Not Loaded";
    case NVML_ERROR_TIMEOUT: return "Timeout";
    case NVML_ERROR_IRQ_ISSUE: return "Interrupt Request Issue";
    case NVML_ERROR_LIBRARY_NOT_FOUND: return "NVML Shared Library Not Found";
    case NVML_ERROR_FUNCTION_NOT_FOUND: return "Function Not Found";
    case NVML_ERROR_CORRUPTED_INFOROM: return "Corrupted infoROM";
    case NVML_ERROR_GPU_IS_LOST: return "GPU is lost";
    case NVML_ERROR_RESET_REQUIRED: return "GPU requires restart";
    case NVML_ERROR_OPERATING_SYSTEM: return "The operating system has blocked the request.";
    case NVML_ERROR_LIB_RM_VERSION_MISMATCH: return "RM has detected an NVML/RM version mismatch.";
    case NVML_ERROR_MEMORY: return "Insufficient Memory";
    case NVML_ERROR_NO_DATA: return "No data";
    case NVML_ERROR_NOT_READY: return "Not Ready";
    case NVML_ERROR_GPU_NOT_FOUND: return "GPU not found";
    default: return "Unknown Error";
    }
}

/* ---------------------------------------------------------------- system queries */

nvmlReturn_t nvmlSystemGetDriverVersion(char *version, unsigned int length) {
    nvmlReturn_t r = enter("nvmlSystemGetDriverVersion");
    if (r != NVML_SUCCESS) return r;
    return leave(copy_string(version, length, g_state->driver_version));
}

nvmlReturn_t nvmlSystemGetNVMLVersion(char *version, unsigned int length) {
    nvmlReturn_t r = enter("nvmlSystemGetNVMLVersion");
    if (r != NVML_SUCCESS) return r;
    return leave(copy_string(version, length, g_state->nvml_version));
}

static nvmlReturn_t cuda_version(const char *function, int *out) {
    nvmlReturn_t r = enter(function);
    if (r != NVML_SUCCESS) return r;
    if (!out) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *out = g_state->cuda_driver_version;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlSystemGetCudaDriverVersion(int *v) { return cuda_version("nvmlSystemGetCudaDriverVersion", v); }
nvmlReturn_t nvmlSystemGetCudaDriverVersion_v2(int *v) { return cuda_version("nvmlSystemGetCudaDriverVersion_v2", v); }

/* ---------------------------------------------------------------- device enumeration */

static nvmlReturn_t device_count(const char *function, unsigned int *count) {
    nvmlReturn_t r = enter(function);
    if (r != NVML_SUCCESS) return r;
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *count = (unsigned int)g_state->ndevs;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetCount_v2(unsigned int *c) { return device_count("nvmlDeviceGetCount_v2", c); }
nvmlReturn_t nvmlDeviceGetCount(unsigned int *c) { return device_count("nvmlDeviceGetCount", c); }

static nvmlReturn_t handle_by_index(const char *function, unsigned int index, nvmlDevice_t *device) {
    nvmlReturn_t r = enter(function);
    if (r != NVML_SUCCESS) return r;
    if (!device || index >= (unsigned int)g_state->ndevs) return leave(NVML_ERROR_INVALID_ARGUMENT);
    g_gpu_handles[index].gpu = (int)index;
    g_gpu_handles[index].mig = -1;
    *device = (nvmlDevice_t)&g_gpu_handles[index];
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetHandleByIndex_v2(unsigned int i, nvmlDevice_t *d) {
    return handle_by_index("nvmlDeviceGetHandleByIndex_v2", i, d);
}
nvmlReturn_t nvmlDeviceGetHandleByIndex(unsigned int i, nvmlDevice_t *d) {
    return handle_by_index("nvmlDeviceGetHandleByIndex", i, d);
}

static nvmlDevice_t mig_handle(int gpu, int mig) {
    g_mig_handles[gpu][mig].gpu = gpu;
    g_mig_handles[gpu][mig].mig = mig;
    return (nvmlDevice_t)&g_mig_handles[gpu][mig];
}

nvmlReturn_t nvmlDeviceGetHandleByUUID(const char *uuid, nvmlDevice_t *device) {
    nvmlReturn_t r = enter("nvmlDeviceGetHandleByUUID");
    if (r != NVML_SUCCESS) return r;
    if (!uuid || !device) return leave(NVML_ERROR_INVALID_ARGUMENT);
    for (int i = 0; i < g_state->ndevs; i++) {
        fdev *d = &g_state->devs[i];
        if (strcmp(d->uuid, uuid) == 0) {
            g_gpu_handles[i].gpu = i;
            g_gpu_handles[i].mig = -1;
            *device = (nvmlDevice_t)&g_gpu_handles[i];
            return leave(NVML_SUCCESS);
        }
        for (int m = 0; m < d->nmigs; m++) {
            if (strcmp(d->migs[m].uuid, uuid) == 0) {
                *device = mig_handle(i, m);
                return leave(NVML_SUCCESS);
            }
        }
    }
    return leave(NVML_ERROR_NOT_FOUND);
}

/* ---------------------------------------------------------------- device properties */

nvmlReturn_t nvmlDeviceGetUUID(nvmlDevice_t device, char *uuid, unsigned int length) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetUUID");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetUUID", &d)) != NVML_SUCCESS) return leave(r);
    return leave(copy_string(uuid, length, d->uuid));
}

nvmlReturn_t nvmlDeviceGetName(nvmlDevice_t device, char *name, unsigned int length) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetName");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetName", &d)) != NVML_SUCCESS) return leave(r);
    return leave(copy_string(name, length, d->name));
}

nvmlReturn_t nvmlDeviceGetIndex(nvmlDevice_t device, unsigned int *index) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetIndex");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetIndex", &d)) != NVML_SUCCESS) return leave(r);
    if (!index) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (d->is_mig) return leave(NVML_ERROR_NOT_SUPPORTED);
    *index = (unsigned int)((const fhandle *)device)->gpu;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMinorNumber(nvmlDevice_t device, unsigned int *minor) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetMinorNumber");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMinorNumber", &d)) != NVML_SUCCESS) return leave(r);
    if (!minor) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *minor = d->minor;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo(nvmlDevice_t device, nvmlMemory_t *memory) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetMemoryInfo");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMemoryInfo", &d)) != NVML_SUCCESS) return leave(r);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    /* v1's used is "the sum of Reserved and Allocated" (nvml.h) */
    unsigned long long used = d->used + d->reserved;
    memory->total = d->total;
    memory->used = used < d->total ? used : d->total;
    memory->free = d->total - memory->used;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMemoryInfo_v2(nvmlDevice_t device, nvmlMemory_v2_t *memory) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetMemoryInfo_v2");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMemoryInfo_v2", &d)) != NVML_SUCCESS) return leave(r);
    if (!memory) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (memory->version != nvmlMemory_v2) return leave(NVML_ERROR_ARGUMENT_VERSION_MISMATCH);
    /* v2 keeps them apart: used is what is allocated, free what is neither */
    memory->total = d->total;
    memory->reserved = d->reserved < d->total ? d->reserved : d->total;
    memory->used = d->used;
    unsigned long long taken = memory->reserved + d->used;
    memory->free = d->total > taken ? d->total - taken : 0;
    return leave(NVML_SUCCESS);
}

/* ---------------------------------------------------------------- process lists */

typedef enum { INFO_V1, INFO_V2 } info_kind;

/* The NVML handshake: too small a buffer (or none) gets the needed count and
 * INSUFFICIENT_SIZE; an empty list is SUCCESS with count 0. */
static nvmlReturn_t running_processes(const char *function, nvmlDevice_t device, int graphics,
                                      unsigned int *count, void *infos, info_kind kind) {
    fdev *d;
    nvmlReturn_t r = enter(function);
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, function, &d)) != NVML_SUCCESS) return leave(r);
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    const fproc *list = graphics ? d->graphics : d->compute;
    unsigned int n = (unsigned int)(graphics ? d->ngraphics : d->ncompute);
    if (*count < n || (n > 0 && !infos)) {
        *count = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    for (unsigned int i = 0; i < n; i++) {
        if (kind == INFO_V1) {
            nvmlProcessInfo_v1_t *out = (nvmlProcessInfo_v1_t *)infos + i;
            out->pid = list[i].pid;
            out->usedGpuMemory = list[i].used;
        } else {
            nvmlProcessInfo_v2_t *out = (nvmlProcessInfo_v2_t *)infos + i;
            out->pid = list[i].pid;
            out->usedGpuMemory = list[i].used;
            out->gpuInstanceId = d->gpu_instance_id;
            out->computeInstanceId = d->compute_instance_id;
        }
    }
    *count = n;
    return leave(NVML_SUCCESS);
}

/* A real driver can take long here (while contexts are torn down, say): the caller spends
 * that time inside NVML, not waiting for its signals. `query_delay_ms` reproduces it. */
static void query_delay(void) {
    pthread_mutex_lock(&g_lock);
    unsigned int ms = g_state_ok ? g_state->query_delay_ms : 0;
    pthread_mutex_unlock(&g_lock);
    if (ms) {
        struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
        nanosleep(&ts, NULL);
    }
}

#define PROCESS_LIST(name, graphics, type, kind)                                        \
    nvmlReturn_t name(nvmlDevice_t device, unsigned int *infoCount, type *infos) {      \
        query_delay();                                                                  \
        return running_processes(#name, device, graphics, infoCount, infos, kind);      \
    }

PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v3, 0, nvmlProcessInfo_t, INFO_V2)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses_v2, 0, nvmlProcessInfo_v2_t, INFO_V2)
PROCESS_LIST(nvmlDeviceGetComputeRunningProcesses, 0, nvmlProcessInfo_v1_t, INFO_V1)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v3, 1, nvmlProcessInfo_t, INFO_V2)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses_v2, 1, nvmlProcessInfo_v2_t, INFO_V2)
PROCESS_LIST(nvmlDeviceGetGraphicsRunningProcesses, 1, nvmlProcessInfo_v1_t, INFO_V1)

/* ---------------------------------------------------------------- process utilisation */

/* The driver samples each process's utilisation once per sample period and keeps a buffer
 * of samples; a query returns those newer than `lastSeenTimeStamp`, one per process with
 * some non-zero utilisation, and NOT_FOUND when there is none. The fake holds every
 * compute process at its `sm_util` and `mem_util`: a steady load, sampled at the time of
 * the call (or at the device's fixed `utilization_timestamp_us`). MIG is NOT_SUPPORTED. */
typedef enum { UTIL_SAMPLE, UTIL_INFO_V1 } util_kind;

static unsigned long long now_us(void) {
    struct timeval tv;
    gettimeofday(&tv, NULL);
    return (unsigned long long)tv.tv_sec * 1000000ULL + (unsigned long long)tv.tv_usec;
}

static nvmlReturn_t process_utilization(const char *function, nvmlDevice_t device, void *samples,
                                        unsigned int *count, unsigned long long last_seen,
                                        util_kind kind) {
    fdev *d;
    nvmlReturn_t r = enter(function);
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, function, &d)) != NVML_SUCCESS) return leave(r);
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (d->is_mig || d->mig_mode) return leave(NVML_ERROR_NOT_SUPPORTED);
    unsigned long long stamp = d->util_timestamp ? d->util_timestamp : now_us();
    unsigned int n = 0;
    for (int i = 0; i < d->ncompute; i++)
        if (d->compute[i].sm_util || d->compute[i].mem_util) n++;
    if (n == 0 || stamp <= last_seen) return leave(NVML_ERROR_NOT_FOUND);
    if (!samples || *count < n) {
        *count = n;
        return leave(NVML_ERROR_INSUFFICIENT_SIZE);
    }
    unsigned int j = 0;
    for (int i = 0; i < d->ncompute; i++) {
        const fproc *p = &d->compute[i];
        if (!p->sm_util && !p->mem_util) continue;
        if (kind == UTIL_SAMPLE) {
            nvmlProcessUtilizationSample_t *out = (nvmlProcessUtilizationSample_t *)samples + j++;
            memset(out, 0, sizeof *out);
            out->pid = p->pid;
            out->timeStamp = stamp;
            out->smUtil = p->sm_util;
            out->memUtil = p->mem_util;
        } else {
            nvmlProcessUtilizationInfo_v1_t *out = (nvmlProcessUtilizationInfo_v1_t *)samples + j++;
            memset(out, 0, sizeof *out);
            out->pid = p->pid;
            out->timeStamp = stamp;
            out->smUtil = p->sm_util;
            out->memUtil = p->mem_util;
        }
    }
    *count = n;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetProcessUtilization(nvmlDevice_t device, nvmlProcessUtilizationSample_t *utilization,
                                             unsigned int *processSamplesCount, unsigned long long lastSeenTimeStamp) {
    return process_utilization("nvmlDeviceGetProcessUtilization", device, utilization,
                               processSamplesCount, lastSeenTimeStamp, UTIL_SAMPLE);
}

nvmlReturn_t nvmlDeviceGetProcessesUtilizationInfo(nvmlDevice_t device, nvmlProcessesUtilizationInfo_t *info) {
    if (!info) return NVML_ERROR_INVALID_ARGUMENT;
    if (info->version != nvmlProcessesUtilizationInfo_v1) return NVML_ERROR_ARGUMENT_VERSION_MISMATCH;
    return process_utilization("nvmlDeviceGetProcessesUtilizationInfo", device, info->procUtilArray,
                               &info->processSamplesCount, info->lastSeenTimeStamp, UTIL_INFO_V1);
}

/* ---------------------------------------------------------------- MIG */

nvmlReturn_t nvmlDeviceGetMigMode(nvmlDevice_t device, unsigned int *currentMode, unsigned int *pendingMode) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetMigMode");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMigMode", &d)) != NVML_SUCCESS) return leave(r);
    if (!currentMode || !pendingMode) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->has_mig) return leave(NVML_ERROR_NOT_SUPPORTED);
    *currentMode = *pendingMode = d->mig_mode;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMaxMigDeviceCount(nvmlDevice_t device, unsigned int *count) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetMaxMigDeviceCount");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMaxMigDeviceCount", &d)) != NVML_SUCCESS) return leave(r);
    if (!count) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->has_mig || d->is_mig) return leave(NVML_ERROR_NOT_SUPPORTED);
    *count = MAX_MIG_SLOTS;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetMigDeviceHandleByIndex(nvmlDevice_t device, unsigned int index, nvmlDevice_t *migDevice) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetMigDeviceHandleByIndex");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMigDeviceHandleByIndex", &d)) != NVML_SUCCESS) return leave(r);
    if (!migDevice || d->is_mig || index >= MAX_MIG_SLOTS) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->has_mig || !d->mig_mode) return leave(NVML_ERROR_INVALID_STATE);
    if (index >= (unsigned int)d->nmigs) return leave(NVML_ERROR_NOT_FOUND);
    *migDevice = mig_handle(((const fhandle *)device)->gpu, (int)index);
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceIsMigDeviceHandle(nvmlDevice_t device, unsigned int *isMigDevice) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceIsMigDeviceHandle");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceIsMigDeviceHandle", &d)) != NVML_SUCCESS) return leave(r);
    if (!isMigDevice) return leave(NVML_ERROR_INVALID_ARGUMENT);
    *isMigDevice = (unsigned int)d->is_mig;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetDeviceHandleFromMigDeviceHandle(nvmlDevice_t migDevice, nvmlDevice_t *device) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceGetDeviceHandleFromMigDeviceHandle");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(migDevice, "nvmlDeviceGetDeviceHandleFromMigDeviceHandle", &d)) != NVML_SUCCESS) return leave(r);
    if (!device || !d->is_mig) return leave(NVML_ERROR_INVALID_ARGUMENT);
    int gpu = ((const fhandle *)migDevice)->gpu;
    g_gpu_handles[gpu].gpu = gpu;
    g_gpu_handles[gpu].mig = -1;
    *device = (nvmlDevice_t)&g_gpu_handles[gpu];
    return leave(NVML_SUCCESS);
}

static nvmlReturn_t instance_id(const char *function, nvmlDevice_t device, unsigned int *id, int compute) {
    fdev *d;
    nvmlReturn_t r = enter(function);
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, function, &d)) != NVML_SUCCESS) return leave(r);
    if (!id) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (!d->is_mig) return leave(NVML_ERROR_NOT_SUPPORTED);
    *id = compute ? d->compute_instance_id : d->gpu_instance_id;
    return leave(NVML_SUCCESS);
}

nvmlReturn_t nvmlDeviceGetGpuInstanceId(nvmlDevice_t device, unsigned int *id) {
    return instance_id("nvmlDeviceGetGpuInstanceId", device, id, 0);
}

nvmlReturn_t nvmlDeviceGetComputeInstanceId(nvmlDevice_t device, unsigned int *id) {
    return instance_id("nvmlDeviceGetComputeInstanceId", device, id, 1);
}

/* ---------------------------------------------------------------- per-cgroup memory limits
 *
 * nvmlDeviceSetMemoryLimits_v1 / nvmlDeviceGetMemoryLimits_v1 (R615+): the codes nvml.h
 * declares, and the behaviour NVIDIA's documents describe (README.md beside this file
 * cites each). Every accepted Set is appended as one JSON line to
 * "<FAKE_NVML_STATE>.limits.jsonl": what the driver would have written, shared by every
 * process that loads the fake, as the driver's state is. What a cgroup holds is replayed
 * from those lines: its own last Set (by inode, so that a cgroup re-created at the same
 * path starts without limits, as a new kernel object would) and, on the dmem backend, what
 * its descendants' soft limits added to its dmem.min, which stays when a descendant is
 * removed without being zeroed first. */

static int driver_major(void) { return atoi(g_state->driver_version); }

/* The cgroup v2 directory behind `path`: OPERATING_SYSTEM when it cannot be opened as one. */
static nvmlReturn_t cgroup_dir(const char *path, struct stat *st) {
    struct statfs fs;
    if (!path || !*path) return NVML_ERROR_INVALID_ARGUMENT;
    if (statfs(path, &fs) != 0 || (unsigned long)fs.f_type != CGROUP2_MAGIC) return NVML_ERROR_OPERATING_SYSTEM;
    if (stat(path, st) != 0 || !S_ISDIR(st->st_mode)) return NVML_ERROR_OPERATING_SYSTEM;
    return NVML_SUCCESS;
}

/* Where a cgroup directory is: the cgroup2 mount that shows it (its mount point, and the
 * cgroup at that point, from /proc/self/mountinfo), the cgroup's own path in the hierarchy
 * ("/" for the root, as /proc/<pid>/cgroup names it), and whether that mount is read-only. */
typedef struct {
    char real[PATH_MAX];
    char mount[PATH_MAX];
    char root[PATH_MAX];
    char rel[PATH_MAX];
    int read_only;
} cgroup_at;

static int below(const char *path, const char *top) {
    size_t n = strlen(top);
    if (strcmp(top, "/") == 0) return path[0] == '/' && path[1] != '\0';
    return strncmp(path, top, n) == 0 && path[n] == '/';
}

static int at_or_below(const char *path, const char *top) { return strcmp(path, top) == 0 || below(path, top); }

static int locate(const char *path, cgroup_at *at) {
    char line[3 * PATH_MAX], root[PATH_MAX], mnt[PATH_MAX];
    struct statvfs vfs;
    size_t best = 0;
    int found = 0;
    if (!realpath(path, at->real)) return 0;
    FILE *f = fopen("/proc/self/mountinfo", "re");
    if (!f) return 0;
    while (fgets(line, sizeof line, f)) {
        const char *sep = strstr(line, " - ");
        if (!sep || strncmp(sep + 3, "cgroup2 ", 8) != 0) continue;
        if (sscanf(line, "%*s %*s %*s %4095s %4095s", root, mnt) != 2) continue;
        size_t n = strcmp(mnt, "/") == 0 ? 0 : strlen(mnt);
        if (n < best || !(n == 0 || at_or_below(at->real, mnt))) continue;
        best = n; /* the deepest mount point wins; of equal ones the last, mounted on top */
        found = 1;
        snprintf(at->mount, sizeof at->mount, "%s", mnt);
        snprintf(at->root, sizeof at->root, "%s", root);
    }
    fclose(f);
    if (!found) return 0;
    const char *rest = at->real + best;
    if (strcmp(at->root, "/") == 0) snprintf(at->rel, sizeof at->rel, "%s", *rest ? rest : "/");
    else snprintf(at->rel, sizeof at->rel, "%s%s", at->root, rest);
    at->read_only = statvfs(at->real, &vfs) == 0 && (vfs.f_flag & ST_RDONLY);
    return 1;
}

/* The directory, through the same mount, of the cgroup `rel`: 0 when that mount does not show it. */
static int path_of(const cgroup_at *at, const char *rel, char *out, size_t size) {
    if (strcmp(at->root, "/") == 0) {
        snprintf(out, size, "%s%s", strcmp(at->mount, "/") == 0 ? "" : at->mount, strcmp(rel, "/") == 0 ? "" : rel);
        if (!*out) snprintf(out, size, "/");
        return 1;
    }
    if (!at_or_below(rel, at->root)) return 0;
    snprintf(out, size, "%s%s", at->mount, rel + strlen(at->root));
    return 1;
}

static void parent_of(char *rel) {
    char *slash = strrchr(rel, '/');
    if (slash == rel) rel[1] = '\0';
    else if (slash) *slash = '\0';
}

/* Whether the cgroup has dmem files: not the root (the kernel gives dmem.max and dmem.min
 * to non-root cgroups only), and no ancestor whose cgroup.subtree_control lacks dmem, as
 * the state's `subtree_without_dmem` says (this kernel may have no dmem controller). */
static int has_dmem_files(const cgroup_at *at) {
    if (strcmp(at->rel, "/") == 0) return 0;
    for (int i = 0; i < g_state->nno_dmem_below; i++) {
        cgroup_at off;
        if (locate(g_state->no_dmem_below[i], &off) && below(at->rel, off.rel)) return 0;
    }
    return 1;
}

/* The inodes of a cgroup's ancestors that this mount shows, the root cgroup left out (it has
 * no dmem.min): those whose dmem.min the driver keeps when a soft limit is set below them. */
static int ancestors(const cgroup_at *at, unsigned long long *out) {
    char rel[PATH_MAX], dir[PATH_MAX];
    struct stat st;
    int n = 0;
    snprintf(rel, sizeof rel, "%s", at->rel);
    for (parent_of(rel); strcmp(rel, "/") != 0 && n < MAX_ANCESTORS; parent_of(rel)) {
        if (!path_of(at, rel, dir, sizeof dir) || stat(dir, &st) != 0) break;
        out[n++] = (unsigned long long)st.st_ino;
    }
    return n;
}

static void records_path(char *out, size_t size) {
    const char *state = getenv("FAKE_NVML_STATE");
    snprintf(out, size, "%s.limits.jsonl", state ? state : "/nonexistent");
}

static void json_escape(char *out, size_t size, const char *in) {
    size_t n = 0;
    for (; *in && n + 7 < size; in++) {
        unsigned char c = (unsigned char)*in;
        if (c == '"' || c == '\\') { out[n++] = '\\'; out[n++] = (char)c; }
        else if (c < 0x20) n += (size_t)snprintf(out + n, size - n, "\\u%04x", c);
        else out[n++] = (char)c;
    }
    out[n] = '\0';
}

static nvmlReturn_t record_limits(const fdev *d, const char *path, const struct stat *st,
                                  unsigned long long soft, unsigned long long hard, unsigned long long asked,
                                  const unsigned long long *up, int nup) {
    char file[PATH_MAX + 32], escaped[2 * PATH_MAX], line[3 * PATH_MAX], list[MAX_ANCESTORS * 24 + 4];
    size_t k = 0;
    records_path(file, sizeof file);
    json_escape(escaped, sizeof escaped, path);
    list[0] = '\0';
    for (int i = 0; i < nup; i++) k += (size_t)snprintf(list + k, sizeof list - k, "%s%llu", i ? ", " : "", up[i]);
    int n = snprintf(line, sizeof line,
                     "{\"device\": \"%s\", \"cgroup\": \"%s\", \"inode\": %llu, \"soft\": %llu, "
                     "\"hard\": %llu, \"asked_hard\": %llu, \"ancestors\": [%s], \"pid\": %d}\n",
                     d->uuid, escaped, (unsigned long long)st->st_ino, soft, hard, asked, list, (int)getpid());
    int fd = open(file, O_WRONLY | O_APPEND | O_CREAT | O_CLOEXEC, 0644);
    if (fd < 0) return NVML_ERROR_UNKNOWN;
    ssize_t wrote = write(fd, line, (size_t)n); /* one write: lines from several processes never mix */
    close(fd);
    return wrote == n ? NVML_SUCCESS : NVML_ERROR_UNKNOWN;
}

/* What the driver holds for one cgroup on one device: its soft limit (dmem.min, with what
 * descendants added), its hard one, and whether it was ever set itself. */
typedef struct {
    unsigned long long ino, soft, hard;
    int own;
} held_t;

typedef struct {
    held_t *v;
    size_t n;
} ledger;

static held_t *held_at(ledger *l, unsigned long long ino, int add) {
    for (size_t i = 0; i < l->n; i++)
        if (l->v[i].ino == ino) return &l->v[i];
    if (!add) return NULL;
    held_t *v = realloc(l->v, (l->n + 1) * sizeof(held_t));
    if (!v) return NULL;
    l->v = v;
    l->v[l->n] = (held_t){ino, 0, NVML_DEVICE_MEMORY_LIMIT_MAX, 0};
    return &l->v[l->n++];
}

static unsigned long long field_u64(const char *from, const char *key) {
    const char *at = strstr(from, key);
    return at ? strtoull(at + strlen(key), NULL, 10) : 0;
}

/* Replay the device's records, oldest first: each Set writes the cgroup's own limits and
 * moves each recorded ancestor's dmem.min by the change of its soft limit. */
static void replay(const fdev *d, ledger *l) {
    char file[PATH_MAX + 32], want_dev[160], line[3 * PATH_MAX];
    records_path(file, sizeof file);
    snprintf(want_dev, sizeof want_dev, "{\"device\": \"%s\", ", d->uuid);
    FILE *f = fopen(file, "re");
    if (!f) return;
    while (fgets(line, sizeof line, f)) {
        const char *from = strstr(line, "\"inode\": ");
        if (strncmp(line, want_dev, strlen(want_dev)) != 0 || !from) continue;
        held_t *h = held_at(l, field_u64(from, "\"inode\": "), 1);
        if (!h) break;
        unsigned long long old = h->soft, soft = field_u64(from, "\"soft\": ");
        h->soft = soft;
        h->hard = field_u64(from, "\"hard\": ");
        h->own = 1;
        const char *list = strstr(from, "\"ancestors\": [");
        for (char *p = list ? (char *)list + 14 : NULL; p && *p && *p != ']';) {
            char *end;
            unsigned long long ino = strtoull(p, &end, 10);
            if (end == p) break;
            held_t *a = held_at(l, ino, 1);
            if (!a) break;
            a->soft = soft >= old ? a->soft + (soft - old) : (a->soft > old - soft ? a->soft - (old - soft) : 0);
            p = end + strspn(end, ", ");
        }
    }
    fclose(f);
}

static int holds_a_limit(const held_t *h) {
    return h && h->own && !(h->soft == 0 && h->hard == NVML_DEVICE_MEMORY_LIMIT_MAX);
}

/* The cgroup a process is in, from /proc/<pid>/cgroup's cgroup v2 line: 0 when unreadable. */
static int process_cgroup(unsigned int pid, char *rel, size_t size) {
    char path[64], line[PATH_MAX];
    int found = 0;
    snprintf(path, sizeof path, "/proc/%u/cgroup", pid);
    FILE *f = fopen(path, "re");
    if (!f) return 0;
    while (!found && fgets(line, sizeof line, f)) {
        if (strncmp(line, "0::", 3) != 0) continue;
        line[strcspn(line, "\n")] = '\0';
        snprintf(rel, size, "%s", line + 3);
        found = 1;
    }
    fclose(f);
    return found;
}

/* On the misc backend limits do not nest: whether a cgroup between the process's (included)
 * and `at` (left out) holds a limit of its own, which then counts the process instead. */
static int counted_below(const cgroup_at *at, const char *prel, ledger *l) {
    char rel[PATH_MAX], dir[PATH_MAX];
    struct stat st;
    snprintf(rel, sizeof rel, "%s", prel);
    for (; below(rel, at->rel); parent_of(rel))
        if (path_of(at, rel, dir, sizeof dir) && stat(dir, &st) == 0 && holds_a_limit(held_at(l, st.st_ino, 0)))
            return 1;
    return 0;
}

/* What the driver charges to a cgroup on a device: the device memory of the processes in its
 * subtree, by /proc/<pid>/cgroup (so a process the listing names but that runs elsewhere, or
 * no longer exists, is not charged), less what they hold as managed memory, which no cgroup
 * is charged for; on the misc backend, less the processes below a cgroup with a limit of its
 * own; nothing at all with `"limits_charge": 0`. */
static unsigned long long charged(const fdev *d, const cgroup_at *at, ledger *l) {
    char prel[PATH_MAX];
    unsigned long long used = 0;
    for (int i = 0; g_state->limits_charge && i < d->ncompute; i++) {
        const fproc *p = &d->compute[i];
        if (p->used == (unsigned long long)NVML_VALUE_NOT_AVAILABLE || !process_cgroup(p->pid, prel, sizeof prel)) continue;
        if (!at_or_below(prel, at->rel)) continue;
        if (g_state->limits_misc && counted_below(at, prel, l)) continue;
        used += p->used > p->managed ? p->used - p->managed : 0;
    }
    return used;
}

static nvmlReturn_t limits_supported(const fdev *d) {
    if (driver_major() < FIRST_LIMITS_DRIVER) return NVML_ERROR_NOT_SUPPORTED;
    if (d->is_mig) return NVML_ERROR_NOT_SUPPORTED; /* "MIG handles are not supported" */
    return NVML_SUCCESS;
}

static nvmlReturn_t set_limits(const fdev *d, const char *path, unsigned long long soft, unsigned long long hard) {
    struct stat st;
    cgroup_at at;
    ledger l = {NULL, 0};
    unsigned long long up[MAX_ANCESTORS];
    nvmlReturn_t r = cgroup_dir(path, &st);
    if (r != NVML_SUCCESS) return r;
    if (!locate(path, &at)) return NVML_ERROR_OPERATING_SYSTEM;
    int dmem = !g_state->limits_misc;
    if (dmem && !has_dmem_files(&at)) return NVML_ERROR_NOT_FOUND; /* "no dmem files": MPS v3 page */
    if (dmem && at.read_only) return NVML_ERROR_OPERATING_SYSTEM;   /* EROFS writing dmem.max */
    replay(d, &l);
    unsigned long long held = hard;
    if (dmem && hard != NVML_DEVICE_MEMORY_LIMIT_MAX && hard < charged(d, &at, &l)) {
        const held_t *h = held_at(&l, st.st_ino, 0); /* dmem.max below usage: silently unchanged */
        held = h && h->own ? h->hard : NVML_DEVICE_MEMORY_LIMIT_MAX;
    }
    free(l.v);
    int nup = dmem ? ancestors(&at, up) : 0;
    return record_limits(d, path, &st, soft, held, hard, up, nup);
}

nvmlReturn_t nvmlDeviceSetMemoryLimits_v1(nvmlDevice_t device, nvmlSetMemoryLimits_v1_t *limits) {
    fdev *d;
    nvmlReturn_t r = enter("nvmlDeviceSetMemoryLimits_v1");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceSetMemoryLimits_v1", &d)) != NVML_SUCCESS) return leave(r);
    if ((r = limits_supported(d)) != NVML_SUCCESS) return leave(r);
    if (!limits) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if (geteuid() != 0) return leave(NVML_ERROR_NO_PERMISSION); /* "Requires root/admin permissions" */
    int clearing = limits->softLimit == 0 && limits->hardLimit == NVML_DEVICE_MEMORY_LIMIT_MAX;
    if (limits->softLimit > limits->hardLimit || (!clearing && limits->hardLimit > d->total))
        return leave(NVML_ERROR_INVALID_ARGUMENT);
    return leave(set_limits(d, limits->nameSpace, limits->softLimit, limits->hardLimit));
}

nvmlReturn_t nvmlDeviceGetMemoryLimits_v1(nvmlDevice_t device, nvmlGetMemoryLimits_v1_t *limits) {
    fdev *d;
    struct stat st;
    cgroup_at at;
    nvmlReturn_t r = enter("nvmlDeviceGetMemoryLimits_v1");
    if (r != NVML_SUCCESS) return r;
    if ((r = resolve(device, "nvmlDeviceGetMemoryLimits_v1", &d)) != NVML_SUCCESS) return leave(r);
    if ((r = limits_supported(d)) != NVML_SUCCESS) return leave(r);
    if (!limits) return leave(NVML_ERROR_INVALID_ARGUMENT);
    if ((r = cgroup_dir(limits->nameSpace, &st)) != NVML_SUCCESS) return leave(r);
    if (!locate(limits->nameSpace, &at)) return leave(NVML_ERROR_OPERATING_SYSTEM);
    /* "Unable to get memory limit: Not Supported" where the cgroup has no dmem files (Dynamo guide) */
    if (!g_state->limits_misc && !has_dmem_files(&at)) return leave(NVML_ERROR_NOT_SUPPORTED);
    ledger l = {NULL, 0};
    replay(d, &l);
    const held_t *h = held_at(&l, st.st_ino, 0);
    if (!h || (!h->own && h->soft == 0)) r = NVML_ERROR_NOT_FOUND; /* never set here, nothing below */
    else {
        limits->softLimit = h->soft;
        limits->hardLimit = h->hard;
        limits->currentUsed = charged(d, &at, &l);
    }
    free(l.v);
    return leave(r);
}
