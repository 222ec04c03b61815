/* The router's relay of plain tokens: an engine's Session frame read here, and each plain output
 * of a request the relay holds (a streaming answer's next tokens, nothing else) written to its
 * client's socket as the server-sent event Python would have written, without touching one of
 * Python's objects. Everything else is declined, for Python to handle as before.
 *
 * Why C: on two cores shared with the engines, a token's relay in Python (the session's frame,
 * the request's text stream, the SSE chunk, the transport) read about fifty objects that the
 * engines' weights had evicted since the previous token. Here a token reads the frame, one
 * slot of a few cache lines and one entry of the token table (pdserve/router/token_relay.py).
 *
 * A slot is a request the router registered, found by its id on one engine session: a duplicate of its
 * client's socket (so a closed connection's descriptor, reused by another, is never written),
 * its chunk's template around the text, and what it relayed since Python last took it (token
 * ids, inter-token gaps, text, and the bytes of a chunk the socket did not take). Python makes a
 * slot active only while its own side of the request is idle and in step (nothing queued,
 * nothing held back, the client's transport empty); the relay makes it inactive at the first
 * output it declines, so a request's outputs leave in order, whichever side sends them.
 *
 * Single-threaded: every call comes from the router's event loop. */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#define MAX_SLOTS 4096 /* a power of two, above the requests one router streams at once */
#define MAX_ID 128
#define MAX_TOKENS 256 /* tokens of one output (a step gives one; a resume a few) */

/* Each token's text: JSON-escaped without quotes, and raw UTF-8; an empty entry is a token with
 * no whole text of its own (declined). One a tokenizer; the buffers are Python's, kept alive
 * there while a request uses them. */
typedef struct {
    int32_t size;
    const char *json, *raw;
    const int32_t *json_offset, *raw_offset;
} table_t;

typedef struct {
    int used, active, fd, session, id_len;
    const table_t *table;
    char id[MAX_ID];
    char *head, *tail; /* the chunk's JSON before and after the text's string */
    int head_len, tail_len;
    int64_t *ids;
    int n_ids, cap_ids;
    double *gaps;
    int n_gaps, cap_gaps;
    char *text, *rest;
    size_t text_len, text_cap, rest_len;
    double last_at;  /* CLOCK_MONOTONIC seconds of the request's latest token (Python's perf_counter) */
    uint64_t cached; /* num_cached_tokens Python has seen: a larger one is Python's to record */
} slot_t;

static slot_t slots[MAX_SLOTS];

table_t *relay_new_table(int32_t size, const char *json, const int32_t *json_offset, const char *raw,
                         const int32_t *raw_offset) {
    table_t *t = malloc(sizeof *t);
    if (t) *t = (table_t){size, json, raw, json_offset, raw_offset};
    return t;
}

void relay_free_table(table_t *t) { free(t); }

static uint32_t home(int session, const char *id, int n) {
    uint64_t h = 1469598103934665603ull ^ (uint64_t)(uint32_t)session;
    for (int i = 0; i < n; i++) h = (h ^ (uint8_t)id[i]) * 1099511628211ull;
    return (uint32_t)(h ^ (h >> 32)) & (MAX_SLOTS - 1);
}

/* Linear probing; deletion shifts the chain back, so a miss stops at the first free slot. */
static int find(int session, const char *id, int n) {
    for (uint32_t k = 0, i = home(session, id, n); k < MAX_SLOTS; k++, i = (i + 1) & (MAX_SLOTS - 1)) {
        slot_t *s = &slots[i];
        if (!s->used) return -1;
        if (s->session == session && s->id_len == n && memcmp(s->id, id, (size_t)n) == 0) return (int)i;
    }
    return -1;
}

/* Hold a new request: 0, or -1 (an id too long or already held, a full table, no memory, a
 * socket that cannot be duplicated): Python then relays it itself. */
int relay_register(int session, const char *id, int n, const table_t *table, int fd, const char *head,
                   int head_len, const char *tail, int tail_len) {
    if (n <= 0 || n > MAX_ID || find(session, id, n) >= 0) return -1;
    for (uint32_t k = 0, i = home(session, id, n); k < MAX_SLOTS; k++, i = (i + 1) & (MAX_SLOTS - 1)) {
        slot_t *s = &slots[i];
        if (s->used) continue;
        char *h = malloc((size_t)head_len + 1), *t = malloc((size_t)tail_len + 1);
        int own = fcntl(fd, F_DUPFD_CLOEXEC, 0);
        if (!h || !t || own < 0) {
            free(h);
            free(t);
            if (own >= 0) close(own);
            return -1;
        }
        memset(s, 0, sizeof *s);
        s->used = 1;
        s->session = session;
        s->table = table;
        s->fd = own;
        s->id_len = n;
        memcpy(s->id, id, (size_t)n);
        memcpy(h, head, (size_t)head_len);
        memcpy(t, tail, (size_t)tail_len);
        s->head = h;
        s->head_len = head_len;
        s->tail = t;
        s->tail_len = tail_len;
        return 0;
    }
    return -1;
}

/* Relay the request's next outputs: Python's side is idle and in step with it (0; -1: not held). */
int relay_activate(int session, const char *id, int n, double last_at, int64_t cached) {
    int i = find(session, id, n);
    if (i < 0) return -1;
    slots[i].last_at = last_at;
    slots[i].cached = (uint64_t)cached;
    slots[i].active = 1;
    return 0;
}

/* Stop relaying the request, and say what it relayed since the last take (0; -1: not held):
 * ``relay_take`` then copies that out and clears it. */
int relay_counts(int session, const char *id, int n, int32_t *n_ids, int32_t *n_gaps, int64_t *text_len,
                 int64_t *rest_len, double *last_at) {
    int i = find(session, id, n);
    if (i < 0) return -1;
    slot_t *s = &slots[i];
    s->active = 0;
    *n_ids = s->n_ids;
    *n_gaps = s->n_gaps;
    *text_len = (int64_t)s->text_len;
    *rest_len = (int64_t)s->rest_len;
    *last_at = s->last_at;
    return 0;
}

void relay_take(int session, const char *id, int n, int64_t *ids, double *gaps, char *text, char *rest) {
    int i = find(session, id, n);
    if (i < 0) return;
    slot_t *s = &slots[i];
    if (s->n_ids) memcpy(ids, s->ids, sizeof(int64_t) * (size_t)s->n_ids);
    if (s->n_gaps) memcpy(gaps, s->gaps, sizeof(double) * (size_t)s->n_gaps);
    if (s->text_len) memcpy(text, s->text, s->text_len);
    if (s->rest_len) memcpy(rest, s->rest, s->rest_len);
    free(s->rest);
    s->rest = NULL;
    s->n_ids = s->n_gaps = 0;
    s->text_len = s->rest_len = 0;
}

/* Let go of the request (after a take: what it relayed since is dropped). */
void relay_unregister(int session, const char *id, int n) {
    int i = find(session, id, n);
    if (i < 0) return;
    slot_t *s = &slots[i];
    close(s->fd);
    free(s->head);
    free(s->tail);
    free(s->ids);
    free(s->gaps);
    free(s->text);
    free(s->rest);
    memset(s, 0, sizeof *s);
    /* Shift the chain after it back over the hole: every entry stays reachable from its home. */
    uint32_t hole = (uint32_t)i;
    for (uint32_t j = (hole + 1) & (MAX_SLOTS - 1); slots[j].used; j = (j + 1) & (MAX_SLOTS - 1)) {
        uint32_t h = home(slots[j].session, slots[j].id, slots[j].id_len);
        /* j's entry may move to the hole unless its home lies cyclically in (hole, j]. */
        int stays = hole <= j ? (hole < h && h <= j) : (hole < h || h <= j);
        if (stays) continue;
        slots[hole] = slots[j];
        memset(&slots[j], 0, sizeof slots[j]);
        hole = j;
    }
}

static int read_varint(const uint8_t **p, const uint8_t *end, uint64_t *v) {
    uint64_t x = 0;
    for (int shift = 0; shift < 64 && *p < end; shift += 7) {
        uint8_t b = *(*p)++;
        x |= (uint64_t)(b & 0x7f) << shift;
        if (!(b & 0x80)) {
            *v = x;
            return 0;
        }
    }
    return -1;
}

static int skip_field(const uint8_t **p, const uint8_t *end, int wire) {
    uint64_t v;
    switch (wire) {
        case 0: return read_varint(p, end, &v);
        case 1: if (end - *p < 8) return -1; *p += 8; return 0;
        case 5: if (end - *p < 4) return -1; *p += 4; return 0;
        case 2:
            if (read_varint(p, end, &v) || v > (uint64_t)(end - *p)) return -1;
            *p += v;
            return 0;
        default: return -1;
    }
}

/* One EngineGenerateResponse's fields: its id, its tokens, and whether it carries anything but
 * those (a finish, a timeline, an error, KV parameters) or more cached tokens than ``cached``
 * gives. -1: malformed. */
typedef struct {
    const char *id;
    int id_len, n, other;
    uint64_t cached;
    int64_t tokens[MAX_TOKENS];
} output_t;

static int parse_output(const uint8_t *p, const uint8_t *end, output_t *o) {
    o->id = NULL;
    o->id_len = o->n = o->other = 0;
    o->cached = 0;
    while (p < end) {
        uint64_t key, v;
        if (read_varint(&p, end, &key)) return -1;
        int field = (int)(key >> 3), wire = (int)(key & 7);
        if (field == 1 && wire == 2) {
            if (read_varint(&p, end, &v) || v > (uint64_t)(end - p)) return -1;
            o->id = (const char *)p;
            o->id_len = (int)v;
            p += v;
        } else if (field == 2 && wire == 2) { /* packed token ids */
            if (read_varint(&p, end, &v) || v > (uint64_t)(end - p)) return -1;
            const uint8_t *q = p, *qe = p + v;
            while (q < qe) {
                uint64_t t;
                if (read_varint(&q, qe, &t)) return -1;
                if (o->n == MAX_TOKENS) o->other = 1;
                else o->tokens[o->n++] = (int64_t)t;
            }
            p = qe;
        } else if (field == 2 && wire == 0) { /* an unpacked token id */
            if (read_varint(&p, end, &v)) return -1;
            if (o->n == MAX_TOKENS) o->other = 1;
            else o->tokens[o->n++] = (int64_t)v;
        } else if (field == 5 && wire == 0) { /* num_cached_tokens */
            if (read_varint(&p, end, &o->cached)) return -1;
        } else if (field == 8 && wire == 0) { /* num_prefix_hit_tokens: Python reads it once */
            if (read_varint(&p, end, &v)) return -1;
        } else {
            if (skip_field(&p, end, wire)) return -1;
            o->other = 1;
        }
    }
    return 0;
}

static int reserve(void **data, int *cap, int need, size_t size) {
    if (need <= *cap) return 0;
    int c = *cap ? *cap : 64;
    while (c < need) c *= 2;
    void *q = realloc(*data, (size_t)c * size);
    if (!q) return -1;
    *data = q;
    *cap = c;
    return 0;
}

static int reserve_text(slot_t *s, size_t bytes) {
    if (s->text_len + bytes <= s->text_cap) return 0;
    size_t c = s->text_cap ? s->text_cap : 256;
    while (c < s->text_len + bytes) c *= 2;
    char *q = realloc(s->text, c);
    if (!q) return -1;
    s->text = q;
    s->text_cap = c;
    return 0;
}

static void append_text(slot_t *s, const output_t *o) {
    const table_t *table = s->table;
    for (int k = 0; k < o->n; k++) {
        int64_t t = o->tokens[k];
        size_t len = (size_t)(table->raw_offset[t + 1] - table->raw_offset[t]);
        memcpy(s->text + s->text_len, table->raw + table->raw_offset[t], len);
        s->text_len += len;
    }
}

enum { DECLINED = 0, SENT = 1, SENT_IN_PART = 2 };

/* Relay one output: DECLINED (Python's: the slot is inactive from here), SENT, or SENT_IN_PART
 * (the socket took part of the chunk: the rest waits in the slot for Python's transport, and
 * the slot is inactive). */
static int relay_output(int session, const output_t *o, double now) {
    if (!o->id) return DECLINED;
    int i = find(session, o->id, o->id_len);
    if (i < 0) return DECLINED;
    slot_t *s = &slots[i];
    if (!s->active) return DECLINED;
    if (o->other || o->n == 0 || o->cached > s->cached) {
        s->active = 0;
        return DECLINED;
    }
    const table_t *table = s->table;
    size_t json_bytes = 0, text_bytes = 0;
    for (int k = 0; k < o->n; k++) {
        int64_t t = o->tokens[k];
        if (t < 0 || t >= table->size || table->raw_offset[t + 1] == table->raw_offset[t]) {
            s->active = 0; /* no whole text of its own: Python holds it back */
            return DECLINED;
        }
        json_bytes += (size_t)(table->json_offset[t + 1] - table->json_offset[t]);
        text_bytes += (size_t)(table->raw_offset[t + 1] - table->raw_offset[t]);
    }
    if (reserve((void **)&s->ids, &s->cap_ids, s->n_ids + o->n, sizeof(int64_t)) ||
        reserve((void **)&s->gaps, &s->cap_gaps, s->n_gaps + 1, sizeof(double)) ||
        reserve_text(s, text_bytes)) {
        s->active = 0;
        return DECLINED;
    }
    /* An HTTP/1.1 chunk: its size in hex, then "data: {head}"text"{tail}\n\n" as Python makes it. */
    size_t body = (size_t)s->head_len + 1 + json_bytes + 1 + (size_t)s->tail_len;
    char stack[8192];
    size_t bound = body + 24;
    char *buf = bound <= sizeof stack ? stack : malloc(bound);
    if (!buf) {
        s->active = 0;
        return DECLINED;
    }
    static const char hex[] = "0123456789abcdef";
    char digits[16];
    int nd = 0;
    for (size_t b = body; nd == 0 || b; b >>= 4) digits[nd++] = hex[b & 15];
    char *w = buf;
    while (nd) *w++ = digits[--nd];
    *w++ = '\r';
    *w++ = '\n';
    memcpy(w, s->head, (size_t)s->head_len);
    w += s->head_len;
    *w++ = '"';
    for (int k = 0; k < o->n; k++) {
        int64_t t = o->tokens[k];
        size_t len = (size_t)(table->json_offset[t + 1] - table->json_offset[t]);
        memcpy(w, table->json + table->json_offset[t], len);
        w += len;
    }
    *w++ = '"';
    memcpy(w, s->tail, (size_t)s->tail_len);
    w += s->tail_len;
    *w++ = '\r';
    *w++ = '\n';
    size_t size = (size_t)(w - buf);
    ssize_t sent;
    do sent = send(s->fd, buf, size, MSG_DONTWAIT | MSG_NOSIGNAL);
    while (sent < 0 && errno == EINTR);
    int result = SENT;
    if (sent >= 0 && (size_t)sent < size && !(s->rest = malloc(size - (size_t)sent))) {
        /* Part of a chunk out and no memory for the rest: the stream cannot be mended, so the
         * connection ends, and Python's write finds it so. */
        shutdown(s->fd, SHUT_RDWR);
        sent = -1;
    }
    if (sent < 0) {
        if (buf != stack) free(buf);
        s->active = 0;
        /* Nothing written (a full socket, a client gone): Python's transport writes it, or finds
         * the connection lost. */
        return DECLINED;
    }
    if ((size_t)sent < size) {
        memcpy(s->rest, buf + sent, size - (size_t)sent);
        s->rest_len = size - (size_t)sent;
        s->active = 0;
        result = SENT_IN_PART;
    }
    if (buf != stack) free(buf);
    memcpy(s->ids + s->n_ids, o->tokens, sizeof(int64_t) * (size_t)o->n);
    s->n_ids += o->n;
    s->gaps[s->n_gaps++] = now - s->last_at;
    s->last_at = now;
    append_text(s, o);
    return result;
}

/* A SessionResponse of engine session ``session``. Returns -1 when all of it is Python's (it
 * carries errors or aborts, or is malformed: then nothing was relayed), else the number of its
 * outputs declined, their indexes in ``declined``; ``flush`` gets the indexes of the outputs
 * whose chunk went in part (``n_flush`` of them), for Python to hand the rest to the transport. */
int relay_frame(int session, const uint8_t *p, int64_t len, int32_t *declined, int32_t max_declined,
                int32_t *flush, int32_t *n_flush) {
    const uint8_t *end = p + len, *q = p;
    int outputs = 0;
    *n_flush = 0;
    while (q < end) { /* every field an output, every output well-formed: else Python's */
        uint64_t key, v;
        if (read_varint(&q, end, &key) || key != ((1u << 3) | 2)) return -1;
        if (read_varint(&q, end, &v) || v > (uint64_t)(end - q)) return -1;
        output_t o;
        if (parse_output(q, q + v, &o)) return -1;
        q += v;
        outputs++;
    }
    if (outputs > max_declined) return -1;
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    int index = 0, n_declined = 0;
    while (p < end) {
        uint64_t key = 0, v = 0; /* read once already: well-formed */
        read_varint(&p, end, &key);
        read_varint(&p, end, &v);
        output_t o;
        parse_output(p, p + v, &o);
        p += v;
        int result = relay_output(session, &o, now);
        if (result == DECLINED) declined[n_declined++] = index;
        else if (result == SENT_IN_PART) flush[(*n_flush)++] = index;
        index++;
    }
    return n_declined;
}
