/*
 * libdsec_inject.so: reports a native training process to a DSec control plane (docs/native.md).
 *
 * Layout of this file:
 *   1. counters           what the host's calls update (one mutex, O(1) work per call)
 *   2. interposition      cudaMalloc / cudaFree / ncclAllReduce, real functions via RTLD_NEXT or dlopen
 *   3. HTTP client        POSIX sockets, HTTP/1.1 (http:// only), one connection per request, deadlines
 *   4. reporter thread    register, heartbeats (seq, metrics), backoff, final beat and deregistration
 *   5. public API         dsec_init / dsec_report_episode_end / dsec_shutdown
 *   6. lifecycle          constructor (auto-start when preloaded), destructor, fork handlers
 *
 * Rules kept throughout: the host never waits on the network (only the explicit lifecycle calls wait, and
 * boundedly); nothing is written to stdout; stderr only with DSEC_DEBUG; no signal is raised (MSG_NOSIGNAL,
 * the reporter thread blocks all signals); a missing CUDA/NCCL symbol is an error code, never a crash.
 */
#define _GNU_SOURCE
#include "dsec_inject.h"

#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <sys/time.h>
#include <sys/types.h>
#include <time.h>
#include <unistd.h>

#define DSEC_API __attribute__((visibility("default")))

#define CUDA_ERROR_INITIALIZATION 3 /* cudaErrorInitializationError */
#define NCCL_SYSTEM_ERROR 2         /* ncclSystemError */

#define REQUEST_TIMEOUT_S 2.0 /* one HTTP exchange (connect + send + answer) */
#define FINAL_TIMEOUT_S 1.0   /* each exchange after the stop (registration, final beat, deregistration) */
#define STOP_BUDGET_S 2.5     /* everything after the stop, together */
#define JOIN_TIMEOUT_S 3.0    /* how long dsec_shutdown / exit wait for the thread */
#define MAX_BACKOFF_S 30.0
#define IO_SLICE_MS 50 /* SO_RCVTIMEO/SO_SNDTIMEO: how often a blocked exchange checks deadline and stop */
#define BODY_CAP 8192
#define RESP_CAP 65536

static int g_debug;
static char *g_cudart_override; /* DSEC_CUDART_LIB */
static char *g_nccl_override;   /* DSEC_NCCL_LIB */

__attribute__((format(printf, 1, 2))) static void debug(const char *fmt, ...)
{
    if (!g_debug)
        return;
    char line[1024];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(line, sizeof line, fmt, ap);
    va_end(ap);
    fprintf(stderr, "dsec-native[%d]: %s\n", (int)getpid(), line);
}

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec / 1e9;
}

/* ============================================================================ 1. counters */

struct stats {
    uint64_t malloc_bytes_total, malloc_count_total, malloc_failures_total, free_count_total;
    uint64_t allocated_bytes; /* gauge: bytes of live allocations seen by cudaMalloc */
    uint64_t allreduce_bytes_total, allreduce_count_total;
    uint64_t episodes_total;
    /* per heartbeat interval (reset when a beat is built) */
    double ar_lat_sum_ms, ar_lat_max_ms;
    uint64_t ar_lat_n;
    double ep_return_sum, ep_length_sum;
    uint64_t ep_return_n, ep_length_n;
};

/* g_mu guards g_stats, the allocation table, and the reporter's stop/done/orphaned flags. */
static pthread_mutex_t g_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t g_cv; /* CLOCK_MONOTONIC; the reporter sleeps on it between beats */
static struct stats g_stats;

/* Live allocations (pointer -> size) so that cudaFree can lower cuda_allocated_bytes: open addressing,
 * linear probing, backward-shift deletion; key 0 = empty. An allocation the table cannot hold (out of
 * host memory) is simply not tracked. */
struct slot {
    uintptr_t key;
    size_t size;
};
static struct slot *g_tab;
static size_t g_tab_cap, g_tab_len;

static size_t tab_hash(uintptr_t k, size_t cap)
{
    uint64_t x = (uint64_t)k;
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdULL;
    x ^= x >> 33;
    return (size_t)x & (cap - 1);
}

static void tab_insert_raw(struct slot *tab, size_t cap, uintptr_t key, size_t size)
{
    size_t i = tab_hash(key, cap);
    while (tab[i].key != 0)
        i = (i + 1) & (cap - 1);
    tab[i].key = key;
    tab[i].size = size;
}

static int tab_grow(void)
{
    size_t cap = g_tab_cap ? g_tab_cap * 2 : 1024;
    struct slot *tab = calloc(cap, sizeof *tab);
    if (tab == NULL)
        return -1;
    for (size_t i = 0; i < g_tab_cap; i++)
        if (g_tab[i].key != 0)
            tab_insert_raw(tab, cap, g_tab[i].key, g_tab[i].size);
    free(g_tab);
    g_tab = tab;
    g_tab_cap = cap;
    return 0;
}

static void tab_put(uintptr_t key, size_t size) /* under g_mu */
{
    if (g_tab_cap) {
        for (size_t i = tab_hash(key, g_tab_cap); g_tab[i].key != 0; i = (i + 1) & (g_tab_cap - 1)) {
            if (g_tab[i].key == key) { /* an address seen again: its free went by unseen */
                g_stats.allocated_bytes -= g_tab[i].size;
                g_tab[i].size = size;
                g_stats.allocated_bytes += size;
                return;
            }
        }
    }
    if ((g_tab_len + 1) * 2 > g_tab_cap && tab_grow() != 0)
        return;
    tab_insert_raw(g_tab, g_tab_cap, key, size);
    g_tab_len++;
    g_stats.allocated_bytes += size;
}

static void tab_take(uintptr_t key) /* under g_mu */
{
    if (!g_tab_cap)
        return;
    size_t mask = g_tab_cap - 1, i = tab_hash(key, g_tab_cap);
    while (g_tab[i].key != key) {
        if (g_tab[i].key == 0)
            return; /* not tracked */
        i = (i + 1) & mask;
    }
    g_stats.allocated_bytes -= g_tab[i].size;
    g_tab_len--;
    for (size_t j = (i + 1) & mask; g_tab[j].key != 0; j = (j + 1) & mask) {
        size_t h = tab_hash(g_tab[j].key, g_tab_cap);
        /* move j back into the hole at i unless its home h lies cyclically in (i, j] */
        int stays = (i <= j) ? (i < h && h <= j) : (i < h || h <= j);
        if (!stays) {
            g_tab[i] = g_tab[j];
            i = j;
        }
    }
    g_tab[i].key = 0;
    g_tab[i].size = 0;
}

/* ============================================================================ 2. interposition */

typedef int (*cuda_malloc_fn)(void **, size_t);
typedef int (*cuda_free_fn)(void *);
typedef int (*nccl_allreduce_fn)(const void *, void *, size_t, int, int, void *, void *);

static const char *const CUDART_NAMES[] = {"libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0",
                                           NULL};
static const char *const NCCL_NAMES[] = {"libnccl.so.2", "libnccl.so", NULL};

/* One interposed function's real implementation: cached once found; while missing, looked for again at most
 * once a second (a library may still be loaded later), and reported once under DSEC_DEBUG. */
struct real {
    const char *sym;
    void *fn;             /* atomic */
    int64_t next_try_ns;  /* atomic */
    int reported;         /* atomic */
};
static struct real g_real_cuda_malloc = {"cudaMalloc", NULL, 0, 0};
static struct real g_real_cuda_free = {"cudaFree", NULL, 0, 0};
static struct real g_real_nccl_allreduce = {"ncclAllReduce", NULL, 0, 0};

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* The next definition of `sym` after this library (RTLD_NEXT); failing that (the real library was loaded
 * with RTLD_LOCAL, or not at all), the library by name: first among those already loaded (RTLD_NOLOAD),
 * then by loading it. `override` (DSEC_CUDART_LIB / DSEC_NCCL_LIB) replaces the list of names. */
static void *resolve(const char *sym, const char *override, const char *const *names, const void *self)
{
    void *fn = dlsym(RTLD_NEXT, sym);
    if (fn != NULL && fn != self)
        return fn;
    const char *one[2] = {override, NULL};
    const char *const *list = (override != NULL && *override) ? one : names;
    for (int pass = 0; pass < 2; pass++) {
        for (const char *const *name = list; *name != NULL; name++) {
            void *handle = dlopen(*name, RTLD_LAZY | RTLD_LOCAL | (pass == 0 ? RTLD_NOLOAD : 0));
            if (handle == NULL)
                continue;
            fn = dlsym(handle, sym);
            if (fn != NULL && fn != self) {
                debug("%s resolved from %s (%s)", sym, *name, pass == 0 ? "already loaded" : "loaded");
                return fn; /* the handle stays open: the function must stay mapped */
            }
            dlclose(handle);
        }
    }
    return NULL;
}

static void *real_fn(struct real *r, const char *override, const char *const *names, const void *self)
{
    void *fn = __atomic_load_n(&r->fn, __ATOMIC_ACQUIRE);
    if (fn != NULL)
        return fn;
    int64_t now = now_ns();
    if (now < __atomic_load_n(&r->next_try_ns, __ATOMIC_RELAXED))
        return NULL;
    __atomic_store_n(&r->next_try_ns, now + 1000000000, __ATOMIC_RELAXED);
    fn = resolve(r->sym, override, names, self);
    if (fn != NULL) {
        __atomic_store_n(&r->fn, fn, __ATOMIC_RELEASE);
    } else if (!__atomic_exchange_n(&r->reported, 1, __ATOMIC_RELAXED)) {
        debug("%s: no real implementation found (RTLD_NEXT, then %s%s); returning an error code", r->sym,
              override != NULL ? override : names[0], override != NULL ? "" : " and the other usual names");
    }
    return fn;
}

DSEC_API int cudaMalloc(void **devPtr, size_t size);
DSEC_API int cudaFree(void *devPtr);
DSEC_API int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, void *comm,
                           void *stream);

DSEC_API int cudaMalloc(void **devPtr, size_t size)
{
    cuda_malloc_fn real =
        (cuda_malloc_fn)real_fn(&g_real_cuda_malloc, g_cudart_override, CUDART_NAMES, (void *)cudaMalloc);
    int rc;
    if (real != NULL) {
        rc = real(devPtr, size);
    } else {
        rc = CUDA_ERROR_INITIALIZATION;
        if (devPtr != NULL)
            *devPtr = NULL;
    }
    pthread_mutex_lock(&g_mu);
    if (rc == 0) {
        g_stats.malloc_count_total++;
        g_stats.malloc_bytes_total += size;
        if (devPtr != NULL && *devPtr != NULL)
            tab_put((uintptr_t)*devPtr, size);
    } else {
        g_stats.malloc_failures_total++;
    }
    pthread_mutex_unlock(&g_mu);
    return rc;
}

DSEC_API int cudaFree(void *devPtr)
{
    cuda_free_fn real =
        (cuda_free_fn)real_fn(&g_real_cuda_free, g_cudart_override, CUDART_NAMES, (void *)cudaFree);
    if (real == NULL)
        return CUDA_ERROR_INITIALIZATION;
    int rc = real(devPtr);
    if (rc == 0 && devPtr != NULL) { /* cudaFree(NULL) is the usual "initialize the context" idiom */
        pthread_mutex_lock(&g_mu);
        g_stats.free_count_total++;
        tab_take((uintptr_t)devPtr);
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* Bytes per element of ncclDataType_t (nccl.h): int8, uint8, int32, uint32, int64, uint64, float16,
 * float32, float64, bfloat16, float8e4m3, float8e5m2. Unknown types count 0 bytes. */
static size_t nccl_type_size(int datatype)
{
    static const unsigned char sizes[] = {1, 1, 4, 4, 8, 8, 2, 4, 8, 2, 1, 1};
    return (datatype >= 0 && (size_t)datatype < sizeof sizes) ? sizes[datatype] : 0;
}

DSEC_API int ncclAllReduce(const void *sendbuff, void *recvbuff, size_t count, int datatype, int op, void *comm,
                           void *stream)
{
    nccl_allreduce_fn real = (nccl_allreduce_fn)real_fn(&g_real_nccl_allreduce, g_nccl_override,
                                                        NCCL_NAMES, (void *)ncclAllReduce);
    if (real == NULL)
        return NCCL_SYSTEM_ERROR;
    double t0 = now_s();
    int rc = real(sendbuff, recvbuff, count, datatype, op, comm, stream);
    /* On a GPU this is the enqueue (launch) time: the reduction itself runs later on `stream`. */
    double ms = (now_s() - t0) * 1000.0;
    if (rc == 0) {
        pthread_mutex_lock(&g_mu);
        g_stats.allreduce_count_total++;
        g_stats.allreduce_bytes_total += (uint64_t)count * nccl_type_size(datatype);
        g_stats.ar_lat_sum_ms += ms;
        if (g_stats.ar_lat_n == 0 || ms > g_stats.ar_lat_max_ms)
            g_stats.ar_lat_max_ms = ms;
        g_stats.ar_lat_n++;
        pthread_mutex_unlock(&g_mu);
    }
    return rc;
}

/* ============================================================================ 3. HTTP client */

struct reporter {
    /* configuration (immutable while the thread runs) */
    char host[256], hostport[300], base[256], port[8];
    char pool[256], token[1024], group[129], hostname[256];
    long rank;
    double interval;
    /* protocol state (reporter thread only) */
    int lazy; /* started by LD_PRELOAD: register only once there is something to report (atomic) */
    int registered, register_failures;
    char worker_id[160], worker_token[1024];
    uint64_t seq;
    long long directive_version;
    char *pending; /* a beat sent but not answered: resent as-is (same seq) */
    char *body, *resp;
    /* lifecycle (under g_mu; stop also read atomically, stop_deadline written before it) */
    int stop, done, orphaned;
    double stop_deadline;
    const char *reason;
    pthread_t thread;
};

struct buf {
    char *p;
    size_t cap, len;
    int overflow;
};

static void bput(struct buf *b, const char *s, size_t n)
{
    if (b->overflow || b->len + n >= b->cap) {
        b->overflow = 1;
        return;
    }
    memcpy(b->p + b->len, s, n);
    b->len += n;
    b->p[b->len] = '\0';
}

static void bputs(struct buf *b, const char *s) { bput(b, s, strlen(s)); }

__attribute__((format(printf, 2, 3))) static void bprintf(struct buf *b, const char *fmt, ...)
{
    char tmp[512];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp)
        b->overflow = 1;
    else
        bput(b, tmp, (size_t)n);
}

static void bjson_str(struct buf *b, const char *s)
{
    bputs(b, "\"");
    for (const unsigned char *c = (const unsigned char *)s; *c; c++) {
        if (*c == '"' || *c == '\\') {
            char esc[2] = {'\\', (char)*c};
            bput(b, esc, 2);
        } else if (*c < 0x20 || *c == 0x7f) {
            bprintf(b, "\\u%04x", *c);
        } else {
            bput(b, (const char *)c, 1);
        }
    }
    bputs(b, "\"");
}

static int stopping(struct reporter *r) { return __atomic_load_n(&r->stop, __ATOMIC_ACQUIRE); }

/* Whether the host did anything this library counts (then a lazily started reporter registers). */
static int activity(void)
{
    pthread_mutex_lock(&g_mu);
    int any = g_stats.malloc_count_total || g_stats.malloc_failures_total || g_stats.free_count_total ||
              g_stats.allreduce_count_total || g_stats.episodes_total;
    pthread_mutex_unlock(&g_mu);
    return any;
}

/* http://host[:port][/base] -> host, port, "host[:port]" (Host header), base path without trailing '/'. */
static int parse_endpoint(struct reporter *r, const char *url)
{
    if (url == NULL || strncasecmp(url, "http://", 7) != 0)
        return -1;
    const char *auth = url + 7;
    size_t alen = strcspn(auth, "/?#");
    if (alen == 0 || alen >= sizeof r->hostport || strchr(auth + alen, '?') || strchr(auth + alen, '#'))
        return -1;
    memcpy(r->hostport, auth, alen);
    r->hostport[alen] = '\0';
    for (const char *c = r->hostport; *c; c++)
        if ((unsigned char)*c <= 0x20 || *c == 0x7f)
            return -1; /* it goes into the Host header as is */
    const char *hp = r->hostport, *port = NULL;
    size_t hlen;
    if (hp[0] == '[') { /* [IPv6]:port */
        const char *close = strchr(hp, ']');
        if (close == NULL)
            return -1;
        hp++;
        hlen = (size_t)(close - hp);
        if (close[1] == ':')
            port = close + 2;
        else if (close[1] != '\0')
            return -1;
    } else {
        const char *colon = strchr(hp, ':');
        hlen = colon ? (size_t)(colon - hp) : strlen(hp);
        if (colon != NULL)
            port = colon + 1;
    }
    if (hlen == 0 || hlen >= sizeof r->host || strchr(hp, '@') != NULL)
        return -1;
    memcpy(r->host, hp, hlen);
    r->host[hlen] = '\0';
    if (port != NULL) {
        char *end;
        long p = strtol(port, &end, 10);
        if (*port == '\0' || *end != '\0' || p < 1 || p > 65535)
            return -1;
        snprintf(r->port, sizeof r->port, "%ld", p);
    } else {
        strcpy(r->port, "80");
    }
    const char *path = auth + alen;
    size_t plen = strlen(path);
    while (plen > 0 && path[plen - 1] == '/')
        plen--;
    if (plen >= sizeof r->base)
        return -1;
    memcpy(r->base, path, plen);
    r->base[plen] = '\0';
    for (const char *c = r->base; *c; c++)
        if ((unsigned char)*c <= 0x20 || *c == 0x7f)
            return -1;
    return 0;
}

/* A blocked exchange gives up at `deadline`, and once the reporter is stopped, at its stop deadline. */
static int give_up(struct reporter *r, double deadline)
{
    double now = now_s();
    return now >= deadline || (stopping(r) && now >= r->stop_deadline);
}

static int dial(struct reporter *r, double deadline)
{
    struct addrinfo hints, *res = NULL;
    memset(&hints, 0, sizeof hints);
    hints.ai_family = AF_UNSPEC;
    hints.ai_socktype = SOCK_STREAM;
    int gai = getaddrinfo(r->host, r->port, &hints, &res);
    if (gai != 0) {
        debug("cannot resolve %s: %s", r->host, gai_strerror(gai));
        return -1;
    }
    int fd = -1;
    for (struct addrinfo *ai = res; ai != NULL && fd < 0; ai = ai->ai_next) {
        fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
        if (fd < 0)
            continue;
        int ok = connect(fd, ai->ai_addr, ai->ai_addrlen) == 0;
        if (!ok && errno == EINPROGRESS) {
            for (;;) {
                struct pollfd pfd = {fd, POLLOUT, 0};
                int n = poll(&pfd, 1, IO_SLICE_MS);
                if (n > 0) {
                    int err = 0;
                    socklen_t len = sizeof err;
                    ok = getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) == 0 && err == 0;
                    break;
                }
                if ((n < 0 && errno != EINTR) || give_up(r, deadline))
                    break;
            }
        }
        if (!ok) {
            close(fd);
            fd = -1;
        }
    }
    freeaddrinfo(res);
    if (fd < 0)
        return -1;
    /* Blocking from here on, with short SO_SNDTIMEO/SO_RCVTIMEO slices: each slice re-checks the deadline. */
    int flags = fcntl(fd, F_GETFL);
    fcntl(fd, F_SETFL, flags & ~O_NONBLOCK);
    struct timeval slice = {0, IO_SLICE_MS * 1000};
    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &slice, sizeof slice);
    setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &slice, sizeof slice);
    int one = 1;
    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof one);
    return fd;
}

static int send_all(struct reporter *r, int fd, const char *p, size_t n, double deadline)
{
    while (n > 0) {
        ssize_t k = send(fd, p, n, MSG_NOSIGNAL);
        if (k > 0) {
            p += k;
            n -= (size_t)k;
        } else if (k < 0 && (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR)) {
            if (give_up(r, deadline))
                return -1;
        } else {
            return -1;
        }
    }
    return 0;
}

static const char *find_header_end(const char *p, size_t n)
{
    for (size_t i = 0; i + 3 < n; i++)
        if (p[i] == '\r' && p[i + 1] == '\n' && p[i + 2] == '\r' && p[i + 3] == '\n')
            return p + i + 4;
    return NULL;
}

/* The value of header `name` (lower case, with the colon) between `head` and `end`, or NULL. */
static const char *header_value(const char *head, const char *end, const char *name)
{
    size_t nlen = strlen(name);
    for (const char *line = head; line < end;) {
        const char *eol = memchr(line, '\n', (size_t)(end - line));
        if (eol == NULL)
            break;
        if ((size_t)(eol - line) > nlen && strncasecmp(line, name, nlen) == 0) {
            const char *v = line + nlen;
            while (*v == ' ' || *v == '\t')
                v++;
            return v;
        }
        line = eol + 1;
    }
    return NULL;
}

/* Decode a chunked body in place; returns its length. */
static size_t dechunk(char *body, size_t n)
{
    size_t in = 0, out = 0;
    while (in < n) {
        char *end;
        unsigned long size = strtoul(body + in, &end, 16);
        char *eol = strstr(end, "\r\n");
        if (eol == NULL || size == 0)
            break;
        in = (size_t)(eol - body) + 2;
        if (size > n - in)
            size = n - in;
        memmove(body + out, body + in, size);
        out += size;
        in += size + 2;
    }
    body[out] = '\0';
    return out;
}

/* POST base+path with a JSON body (or none). Returns the HTTP status, or -1 when there was no complete
 * answer (unreachable, timed out, aborted); *answer then points to the NUL-terminated response body. */
static int http_post(struct reporter *r, const char *path, const char *json, const char *token, double deadline,
                     const char **answer)
{
    static const char empty[] = "";
    *answer = empty;
    char head[2048];
    size_t blen = json ? strlen(json) : 0;
    int hn = snprintf(head, sizeof head,
                      "POST %s%s HTTP/1.1\r\nHost: %s\r\nUser-Agent: dsec-native/" DSEC_INJECT_VERSION
                      "\r\nAccept: application/json\r\nConnection: close\r\nContent-Type: application/json\r\n"
                      "Content-Length: %zu\r\n%s%s%s\r\n",
                      r->base, path, r->hostport, blen, token && *token ? "Authorization: Bearer " : "",
                      token && *token ? token : "", token && *token ? "\r\n" : "");
    if (hn < 0 || (size_t)hn >= sizeof head)
        return -1;
    int fd = dial(r, deadline);
    if (fd < 0)
        return -1;
    int status = -1;
    if (send_all(r, fd, head, (size_t)hn, deadline) != 0 ||
        (blen && send_all(r, fd, json, blen, deadline) != 0))
        goto out;
    size_t n = 0;
    const char *body = NULL;
    long want = -1; /* body length from Content-Length; -1: until the server closes */
    int chunked = 0, eof = 0;
    for (;;) {
        if (n + 1 >= RESP_CAP)
            break; /* larger than anything this library reads: keep what fits */
        ssize_t k = recv(fd, r->resp + n, RESP_CAP - 1 - n, 0);
        if (k > 0) {
            n += (size_t)k;
            r->resp[n] = '\0';
        } else if (k == 0) {
            eof = 1;
            break;
        } else if (errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR) {
            if (give_up(r, deadline))
                goto out;
            continue;
        } else {
            goto out;
        }
        if (body == NULL && (body = find_header_end(r->resp, n)) != NULL) {
            const char *cl = header_value(r->resp, body, "content-length:");
            const char *te = header_value(r->resp, body, "transfer-encoding:");
            if (cl != NULL)
                want = strtol(cl, NULL, 10);
            chunked = te != NULL && strncasecmp(te, "chunked", 7) == 0;
        }
        if (body != NULL && !chunked && want >= 0 && (long)(n - (size_t)(body - r->resp)) >= want)
            break;
        if (body != NULL && chunked && strstr(body, "\r\n0\r\n") != NULL)
            break;
    }
    if (body == NULL)
        body = find_header_end(r->resp, n);
    if (body == NULL || (!eof && !chunked && want < 0 && n + 1 < RESP_CAP))
        goto out;
    if (sscanf(r->resp, "HTTP/%*d.%*d %d", &status) != 1)
        status = -1;
    char *b = r->resp + (body - r->resp);
    if (chunked)
        dechunk(b, n - (size_t)(b - r->resp));
    *answer = b;
out:
    close(fd);
    return status;
}

/* Minimal JSON reading: the string or integer value of the first "key" in `json` (answers are ours). */
static const char *json_value(const char *json, const char *key)
{
    char pat[64];
    snprintf(pat, sizeof pat, "\"%s\"", key);
    const char *p = strstr(json, pat);
    if (p == NULL)
        return NULL;
    p += strlen(pat);
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
        p++;
    if (*p != ':')
        return NULL;
    p++;
    while (*p == ' ' || *p == '\t' || *p == '\r' || *p == '\n')
        p++;
    return p;
}

static int json_string(const char *json, const char *key, char *out, size_t cap)
{
    const char *p = json_value(json, key);
    if (p == NULL || *p != '"')
        return -1;
    size_t n = 0;
    for (p++; *p && *p != '"'; p++) {
        if (*p == '\\' || (unsigned char)*p < 0x20 || n + 1 >= cap)
            return -1; /* ids and tokens never need escapes */
        out[n++] = *p;
    }
    if (*p != '"')
        return -1;
    out[n] = '\0';
    return 0;
}

/* The version of the "directive" object in an answer, or -1 when it is null or absent. */
static long long directive_version(const char *json)
{
    const char *p = json_value(json, "directive");
    if (p == NULL || *p != '{')
        return -1;
    p = json_value(p, "version");
    if (p == NULL)
        return -1;
    char *end;
    long long v = strtoll(p, &end, 10);
    return end == p ? -1 : v;
}

static int safe_token(const char *s)
{
    for (; *s; s++)
        if ((unsigned char)*s <= 0x20 || *s == 0x7f)
            return 0;
    return 1;
}

/* ============================================================================ 4. reporter thread */

static int do_register(struct reporter *r, double deadline)
{
    struct buf b = {r->body, BODY_CAP, 0, 0};
    r->body[0] = '\0';
    bputs(&b, "{\"pool\":");
    bjson_str(&b, r->pool);
    bputs(&b, ",\"role\":\"other\",\"group\":");
    bjson_str(&b, r->group);
    bprintf(&b, ",\"rank\":%ld,\"host\":", r->rank);
    bjson_str(&b, r->hostname);
    bprintf(&b, ",\"pid\":%d,\"heartbeat_interval_s\":%.17g}", (int)getpid(), r->interval);
    if (b.overflow)
        return 0;
    const char *answer;
    int status = http_post(r, "/v1/workers/register", r->body, r->token, deadline, &answer);
    if (status != 201 && status != 200) {
        debug("register with %s%s failed: %s%d %.200s", r->hostport, r->base, status < 0 ? "no answer " : "HTTP ",
              status, answer);
        r->register_failures++;
        return 0;
    }
    char id[sizeof r->worker_id], tok[sizeof r->worker_token];
    if (json_string(answer, "worker_id", id, sizeof id) != 0 || json_string(answer, "worker_token", tok, sizeof tok) ||
        !safe_token(id) || !safe_token(tok) || strchr(id, '/') != NULL || strchr(id, '?') != NULL) {
        debug("register answer not understood: %.200s", answer);
        r->register_failures++;
        return 0;
    }
    strcpy(r->worker_id, id);
    strcpy(r->worker_token, tok);
    r->registered = 1;
    r->seq = 0;
    free(r->pending);
    r->pending = NULL;
    long long v = directive_version(answer);
    r->directive_version = v > 0 ? v : 0;
    debug("registered as %s (pool %s, group %s)", r->worker_id, r->pool, r->group);
    return 1;
}

static void add_u64(struct buf *b, int *first, const char *name, uint64_t v)
{
    bprintf(b, "%s\"%s\":%llu", *first ? "" : ",", name, (unsigned long long)v);
    *first = 0;
}

static void add_double(struct buf *b, int *first, const char *name, double v)
{
    if (!isfinite(v))
        return;
    bprintf(b, "%s\"%s\":%.17g", *first ? "" : ",", name, v);
    *first = 0;
}

/* The next beat: cumulative counters, the gauge, and the summaries of the interval since the last one. */
static char *build_beat(struct reporter *r)
{
    struct stats s;
    pthread_mutex_lock(&g_mu);
    s = g_stats;
    g_stats.ar_lat_sum_ms = g_stats.ar_lat_max_ms = 0;
    g_stats.ar_lat_n = 0;
    g_stats.ep_return_sum = g_stats.ep_length_sum = 0;
    g_stats.ep_return_n = g_stats.ep_length_n = 0;
    pthread_mutex_unlock(&g_mu);

    struct buf b = {r->body, BODY_CAP, 0, 0};
    int first = 1;
    r->body[0] = '\0';
    bprintf(&b, "{\"seq\":%llu,\"acked_directive_version\":%lld,\"metrics\":{", (unsigned long long)(r->seq + 1),
            r->directive_version);
    add_u64(&b, &first, "cuda_malloc_bytes_total", s.malloc_bytes_total);
    add_u64(&b, &first, "cuda_malloc_count_total", s.malloc_count_total);
    add_u64(&b, &first, "cuda_malloc_failures_total", s.malloc_failures_total);
    add_u64(&b, &first, "cuda_free_count_total", s.free_count_total);
    add_u64(&b, &first, "cuda_allocated_bytes", s.allocated_bytes);
    add_u64(&b, &first, "nccl_allreduce_bytes_total", s.allreduce_bytes_total);
    add_u64(&b, &first, "nccl_allreduce_count_total", s.allreduce_count_total);
    if (s.ar_lat_n) {
        add_double(&b, &first, "nccl_allreduce_latency_ms_mean", s.ar_lat_sum_ms / (double)s.ar_lat_n);
        add_double(&b, &first, "nccl_allreduce_latency_ms_max", s.ar_lat_max_ms);
        add_u64(&b, &first, "nccl_allreduce_latency_ms_count", s.ar_lat_n);
    }
    add_u64(&b, &first, "episodes_total", s.episodes_total);
    if (s.ep_return_n)
        add_double(&b, &first, "episode_return_mean", s.ep_return_sum / (double)s.ep_return_n);
    if (s.ep_length_n)
        add_double(&b, &first, "episode_length_mean", s.ep_length_sum / (double)s.ep_length_n);
    bputs(&b, "},\"events\":[]}");
    if (b.overflow)
        return NULL;
    r->seq++;
    return strdup(r->body);
}

/* Send the pending beat, or a new one. 1: answered; 0: to retry later (the beat stays pending). */
static int do_beat(struct reporter *r, double deadline)
{
    if (r->pending == NULL && (r->pending = build_beat(r)) == NULL)
        return 0;
    char path[256];
    snprintf(path, sizeof path, "/v1/workers/%s/heartbeat", r->worker_id);
    const char *answer;
    int status = http_post(r, path, r->pending, r->worker_token, deadline, &answer);
    if (status == 200) {
        free(r->pending);
        r->pending = NULL;
        long long v = directive_version(answer);
        if (v > 0) /* no actuators here: a directive is acknowledged as received, like Reporter without a handler */
            r->directive_version = v;
        return 1;
    }
    if (status == 401 || status == 403 || status == 404 || status == 409) {
        debug("worker %s rejected (HTTP %d): registering again", r->worker_id, status);
        r->registered = 0;
        free(r->pending);
        r->pending = NULL;
    } else if (status == 422) {
        debug("beat rejected as invalid, dropped: %.300s", answer);
        free(r->pending);
        r->pending = NULL;
    } else {
        debug("heartbeat failed: %s%d", status < 0 ? "no answer " : "HTTP ", status);
    }
    return 0;
}

static void do_deregister(struct reporter *r, const char *reason, double deadline)
{
    char path[256];
    snprintf(path, sizeof path, "/v1/workers/%s/deregister?reason=%s", r->worker_id, reason);
    const char *answer;
    int status = http_post(r, path, NULL, r->worker_token, deadline, &answer);
    debug("deregistered %s (%s): %s%d", r->worker_id, reason, status < 0 ? "no answer " : "HTTP ", status);
}

static void free_reporter(struct reporter *r)
{
    free(r->pending);
    free(r->body);
    free(r->resp);
    free(r);
}

static double final_deadline(void) { return now_s() + FINAL_TIMEOUT_S; } /* give_up also caps it at the stop budget */

static void *reporter_main(void *arg)
{
    struct reporter *r = arg;
    unsigned seed = (unsigned)getpid() ^ (unsigned)(now_s() * 1e6);
    double backoff = 0;
    while (!stopping(r)) {
        double deadline = now_s() + REQUEST_TIMEOUT_S, wait;
        int ok = 1;
        if (!r->registered && __atomic_load_n(&r->lazy, __ATOMIC_RELAXED) && !activity())
            wait = r->interval < 0.5 ? r->interval : 0.5; /* nothing to report yet: look again soon */
        else if ((ok = r->registered ? do_beat(r, deadline) : do_register(r, deadline)))
            wait = r->interval;
        if (ok) {
            backoff = 0;
        } else {
            backoff = backoff * 2 < 0.25 ? 0.25 : (backoff * 2 > MAX_BACKOFF_S ? MAX_BACKOFF_S : backoff * 2);
            wait = backoff * (0.5 + 0.5 * (double)rand_r(&seed) / RAND_MAX);
        }
        double t = now_s() + wait;
        struct timespec ts = {(time_t)t, (long)((t - (double)(time_t)t) * 1e9)};
        pthread_mutex_lock(&g_mu);
        while (!r->stop && pthread_cond_timedwait(&g_cv, &g_mu, &ts) != ETIMEDOUT) {
        }
        pthread_mutex_unlock(&g_mu);
    }
    /* Stopped (the exchange in flight, if any, was allowed to finish within the stop budget). A short
     * program may stop before its first registration attempt: that one is still made, so that what it
     * counted is reported; a control plane that already failed to answer is not tried again. */
    if (!r->registered && r->register_failures == 0 && (!__atomic_load_n(&r->lazy, __ATOMIC_RELAXED) || activity()))
        do_register(r, final_deadline());
    if (r->registered) { /* final beat: the one still pending first, then the latest counters */
        if (r->pending != NULL)
            do_beat(r, final_deadline());
        if (r->pending == NULL && r->registered)
            do_beat(r, final_deadline());
        if (r->registered)
            do_deregister(r, r->reason ? r->reason : "shutdown", final_deadline());
    }
    pthread_mutex_lock(&g_mu);
    r->done = 1;
    int orphaned = r->orphaned;
    pthread_mutex_unlock(&g_mu);
    if (orphaned)
        free_reporter(r);
    return NULL;
}

/* ============================================================================ 5. public API */

/* g_life serializes dsec_init / dsec_shutdown; g_rep is the running reporter (or NULL). */
static pthread_mutex_t g_life = PTHREAD_MUTEX_INITIALIZER;
static struct reporter *g_rep;
static pthread_once_t g_once = PTHREAD_ONCE_INIT;

static void init_once(void);

static void copy_str(char *dst, size_t cap, const char *src)
{
    snprintf(dst, cap, "%s", src ? src : "");
}

static void sanitize_name(char *out, size_t cap, const char *name)
{
    size_t n = 0;
    for (const char *c = name; *c && n + 1 < cap && n < 128; c++) {
        char ch = *c;
        int ok = (ch >= 'a' && ch <= 'z') || (ch >= 'A' && ch <= 'Z') || (ch >= '0' && ch <= '9') || ch == '_' ||
                 ch == '.' || ch == ':' || ch == '-';
        out[n++] = ok ? ch : '_';
    }
    out[n] = '\0';
    if (n == 0) {
        copy_str(out, cap, "native");
        return;
    }
    char c0 = out[0];
    if (!((c0 >= 'a' && c0 <= 'z') || (c0 >= 'A' && c0 <= 'Z') || (c0 >= '0' && c0 <= '9')))
        out[0] = 'x'; /* names start with a letter or digit */
}

static int start_reporter(const char *endpoint, const char *name, int lazy);

DSEC_API int dsec_init(const char *endpoint, const char *name) { return start_reporter(endpoint, name, 0); }

static int start_reporter(const char *endpoint, const char *name, int lazy)
{
    pthread_once(&g_once, init_once);
    pthread_mutex_lock(&g_life);
    if (g_rep != NULL) {
        if (!lazy) /* asked for explicitly: register now, even with nothing counted yet */
            __atomic_store_n(&g_rep->lazy, 0, __ATOMIC_RELAXED);
        pthread_mutex_unlock(&g_life);
        return DSEC_OK;
    }
    const char *ep = (endpoint && *endpoint) ? endpoint : getenv("DSEC_ENDPOINT");
    const char *pool = getenv("DSEC_SANDBOX_ID");
    struct reporter *r = calloc(1, sizeof *r);
    if (r == NULL) {
        pthread_mutex_unlock(&g_life);
        return DSEC_ERR_THREAD;
    }
    if (ep == NULL || parse_endpoint(r, ep) != 0 || pool == NULL || !*pool || strlen(pool) >= sizeof r->pool) {
        debug("not starting: %s", ep == NULL ? "no endpoint (argument or DSEC_ENDPOINT)"
                                  : (pool == NULL || !*pool) ? "DSEC_SANDBOX_ID is not set"
                                                             : "the endpoint is not http://host[:port][/path]");
        free(r);
        pthread_mutex_unlock(&g_life);
        return DSEC_ERR_CONFIG;
    }
    copy_str(r->pool, sizeof r->pool, pool);
    r->lazy = lazy;
    const char *token = getenv("DSEC_TOKEN");
    if (token != NULL && strlen(token) < sizeof r->token && safe_token(token))
        copy_str(r->token, sizeof r->token, token);
    else if (token != NULL)
        debug("DSEC_TOKEN ignored: too long or contains spaces/control characters");
    const char *nm = (name && *name) ? name : getenv("DSEC_NAME");
    sanitize_name(r->group, sizeof r->group, (nm && *nm) ? nm : program_invocation_short_name);
    if (gethostname(r->hostname, sizeof r->hostname) != 0)
        r->hostname[0] = '\0';
    r->hostname[sizeof r->hostname - 1] = '\0';
    const char *rank = getenv("RANK");
    char *end;
    r->rank = rank ? strtol(rank, &end, 10) : 0;
    if (rank == NULL || *end != '\0' || r->rank < 0 || r->rank > 10000000)
        r->rank = 0;
    const char *iv = getenv("DSEC_HEARTBEAT_INTERVAL");
    r->interval = iv ? strtod(iv, &end) : 5.0;
    if (iv == NULL || end == iv || *end != '\0' || !isfinite(r->interval))
        r->interval = 5.0;
    r->interval = r->interval < 0.05 ? 0.05 : (r->interval > 3600 ? 3600 : r->interval); /* the protocol's range */
    r->body = malloc(BODY_CAP);
    r->resp = malloc(RESP_CAP);
    if (r->body == NULL || r->resp == NULL) {
        free_reporter(r);
        pthread_mutex_unlock(&g_life);
        return DSEC_ERR_THREAD;
    }
    /* The thread takes no signal meant for the host. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int rc = pthread_create(&r->thread, NULL, reporter_main, r);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (rc != 0) {
        debug("cannot start the reporter thread: %s", strerror(rc));
        free_reporter(r);
        pthread_mutex_unlock(&g_life);
        return DSEC_ERR_THREAD;
    }
    pthread_setname_np(r->thread, "dsec-native"); /* named here, so that it has its name from the start */
    g_rep = r;
    debug("reporting to %s%s every %gs as group %s", r->hostport, r->base, r->interval, r->group);
    pthread_mutex_unlock(&g_life);
    return DSEC_OK;
}

DSEC_API void dsec_report_episode_end(double reward, long length)
{
    pthread_mutex_lock(&g_mu);
    g_stats.episodes_total++;
    if (isfinite(reward)) {
        g_stats.ep_return_sum += reward;
        g_stats.ep_return_n++;
    }
    g_stats.ep_length_sum += (double)length;
    g_stats.ep_length_n++;
    pthread_mutex_unlock(&g_mu);
}

static void stop_reporter(const char *reason)
{
    pthread_mutex_lock(&g_life);
    struct reporter *r = g_rep;
    g_rep = NULL;
    if (r == NULL) {
        pthread_mutex_unlock(&g_life);
        return;
    }
    pthread_mutex_lock(&g_mu);
    r->reason = reason;
    r->stop_deadline = now_s() + STOP_BUDGET_S;
    __atomic_store_n(&r->stop, 1, __ATOMIC_RELEASE);
    pthread_cond_broadcast(&g_cv);
    pthread_mutex_unlock(&g_mu);
    struct timespec dl;
    clock_gettime(CLOCK_REALTIME, &dl);
    dl.tv_sec += (time_t)JOIN_TIMEOUT_S;
    if (pthread_timedjoin_np(r->thread, NULL, &dl) == 0) {
        free_reporter(r);
    } else {
        pthread_mutex_lock(&g_mu);
        int done = r->done;
        if (!done)
            r->orphaned = 1; /* the thread frees it when it ends */
        pthread_mutex_unlock(&g_mu);
        if (done) {
            pthread_join(r->thread, NULL);
            free_reporter(r);
        } else {
            debug("reporter thread still busy after %gs; leaving it behind", JOIN_TIMEOUT_S);
            pthread_detach(r->thread);
        }
    }
    pthread_mutex_unlock(&g_life);
}

DSEC_API void dsec_shutdown(void) { stop_reporter("shutdown"); }

/* ============================================================================ 6. lifecycle */

static void init_cv(void)
{
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g_cv, &attr);
    pthread_condattr_destroy(&attr);
}

static void atfork_prepare(void) { pthread_mutex_lock(&g_mu); }

static void atfork_parent(void) { pthread_mutex_unlock(&g_mu); }

/* The child has no reporter thread and its own (new) device state: it starts from nothing. A child that
 * execs reloads the library; one that does not may call dsec_init itself. */
static void atfork_child(void)
{
    g_rep = NULL; /* the parent's; its memory is left as is */
    pthread_mutex_init(&g_life, NULL);
    init_cv();
    memset(&g_stats, 0, sizeof g_stats);
    free(g_tab);
    g_tab = NULL;
    g_tab_cap = g_tab_len = 0;
    pthread_mutex_unlock(&g_mu);
}

static void init_once(void)
{
    const char *d = getenv("DSEC_DEBUG");
    g_debug = d != NULL && *d && strcmp(d, "0") != 0;
    const char *c = getenv("DSEC_CUDART_LIB"), *n = getenv("DSEC_NCCL_LIB");
    g_cudart_override = c && *c ? strdup(c) : NULL;
    g_nccl_override = n && *n ? strdup(n) : NULL;
    init_cv();
    pthread_atfork(atfork_prepare, atfork_parent, atfork_child);
    /* Never unloaded (dlclose is then a no-op): a thread left behind could otherwise outlive its code. */
    Dl_info info;
    if (dladdr((void *)dsec_init, &info) && info.dli_fname != NULL)
        dlopen(info.dli_fname, RTLD_NOW | RTLD_NOLOAD | RTLD_NODELETE);
}

static const char *base_name(const char *path, size_t len, size_t *out_len)
{
    size_t i = len;
    while (i > 0 && path[i - 1] != '/')
        i--;
    *out_len = len - i;
    return path + i;
}

/* Whether this library was named in LD_PRELOAD (as opposed to linked or dlopen'ed, e.g. by ctypes). */
static int preloaded(void)
{
    const char *pre = getenv("LD_PRELOAD");
    Dl_info info;
    if (pre == NULL || !dladdr((void *)dsec_init, &info) || info.dli_fname == NULL)
        return 0;
    size_t mlen;
    const char *me = base_name(info.dli_fname, strlen(info.dli_fname), &mlen);
    for (const char *p = pre; *p;) {
        size_t len = strcspn(p, ": \t");
        size_t blen;
        const char *b = base_name(p, len, &blen);
        if (len > 0 && blen == mlen && strncmp(b, me, mlen) == 0)
            return 1;
        p += len;
        p += strspn(p, ": \t");
    }
    return 0;
}

__attribute__((constructor)) static void dsec_constructor(void)
{
    pthread_once(&g_once, init_once);
    if (getenv("DSEC_ENDPOINT") != NULL && getenv("DSEC_SANDBOX_ID") != NULL && preloaded())
        start_reporter(NULL, NULL, 1);
}

__attribute__((destructor)) static void dsec_destructor(void) { stop_reporter("exit"); }
