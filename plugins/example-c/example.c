/*
 * A pdhost backend in plain C, against include/pdhost_backend.h only.
 *
 * It is the smallest complete backend: it parses its configuration, describes a dense layout, and fills
 * every region it is given. Its "model" is a stand-in a vendor would replace with a device call: the K and
 * V of a position are a fixed function of (layer, token id, position, head, dim), so chunked and whole
 * prefill agree, and the conformance suite can check what arrives against the backend run in-process.
 *
 * Configuration (JSON; unknown keys ignored): the host passes the model's shape in it, so a backend
 * learns its layers without parsing the model's files (docs/plugin-abi.md lists every key):
 *   {"layers": "SSSFSSSF", "kv_heads": 1, "head_dim": 16, "window": 8, ...}
 * `layers` has one letter per model layer: S sliding (over `window` tokens), F full attention. This
 * stand-in reads only those four flat keys, with a parser that finds the first occurrence of each; a
 * real backend would use a JSON library.
 *
 * Build: cc -std=c11 -O2 -fPIC -shared -I plugins/abi/include plugins/example-c/example.c -o libexample.so
 */

#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "pdhost_backend.h"

#define MAX_LAYERS 256

struct PdhostBackend {
    PdhostLayer layers[MAX_LAYERS];
    uint32_t num_layers;
    uint32_t kv_heads;
    uint32_t head_dim;
};

static void set_error(char *err, size_t cap, const char *message) {
    if (err != NULL && cap > 0) {
        snprintf(err, cap, "%s", message);
    }
}

/* The text after "key": in a flat JSON object, or NULL. */
static const char *find_value(const char *json, size_t len, const char *key) {
    char pattern[64];
    snprintf(pattern, sizeof pattern, "\"%s\"", key);
    size_t plen = strlen(pattern);
    for (size_t i = 0; i + plen <= len; i++) {
        if (memcmp(json + i, pattern, plen) == 0) {
            const char *p = json + i + plen;
            while (p < json + len && (*p == ' ' || *p == ':')) {
                p++;
            }
            return p < json + len ? p : NULL;
        }
    }
    return NULL;
}

static long number_or(const char *json, size_t len, const char *key, long fallback) {
    const char *v = find_value(json, len, key);
    return v != NULL ? strtol(v, NULL, 10) : fallback;
}

static uint32_t example_open(const uint8_t *config, size_t config_len, PdhostBackend **out, char *err,
                             size_t err_cap) {
    if (out == NULL || (config == NULL && config_len > 0)) {
        set_error(err, err_cap, "null argument");
        return PDHOST_STATUS_INVALID_ARGUMENT;
    }
    /* Copy the config so that it is NUL-terminated for strtol. */
    char *json = calloc(config_len + 1, 1);
    if (json == NULL) {
        set_error(err, err_cap, "out of memory");
        return PDHOST_STATUS_BACKEND_ERROR;
    }
    if (config_len > 0) {
        memcpy(json, config, config_len);
    }
    PdhostBackend *b = calloc(1, sizeof *b);
    if (b == NULL) {
        free(json);
        set_error(err, err_cap, "out of memory");
        return PDHOST_STATUS_BACKEND_ERROR;
    }
    /* The host leaves out the shape keys for a model whose layers differ (or that has several windows):
       a missing key is refused here rather than guessed, which would only fail later as describe_mismatch. */
    long kv_heads = number_or(json, config_len, "kv_heads", -1);
    long head_dim = number_or(json, config_len, "head_dim", -1);
    long window = number_or(json, config_len, "window", -1);
    const char *layers = find_value(json, config_len, "layers");
    /* Each is narrowed to a uint32_t below: bounded first, so 4294967297 is refused rather than read as 1. */
    if (layers == NULL || *layers != '"' || kv_heads < 1 || head_dim < 1 || kv_heads > 65536 || head_dim > 65536) {
        set_error(err, err_cap,
                  "config: expected \"layers\" (a string of S and F), and kv_heads and head_dim from 1 to 65536");
        free(json);
        free(b);
        return PDHOST_STATUS_BAD_CONFIG;
    }
    for (const char *p = layers + 1; *p != '"' && *p != '\0'; p++) {
        if (b->num_layers == MAX_LAYERS || (*p != 'S' && *p != 'F')) {
            set_error(err, err_cap, "config layers: expected at most 256 letters S or F");
            free(json);
            free(b);
            return PDHOST_STATUS_BAD_CONFIG;
        }
        if (*p == 'S' && (window < 1 || (uint64_t)window > UINT32_MAX)) {
            set_error(err, err_cap, "config: expected a window from 1 to 4294967295 for the S layers");
            free(json);
            free(b);
            return PDHOST_STATUS_BAD_CONFIG;
        }
        PdhostLayer *l = &b->layers[b->num_layers++];
        l->kind = *p == 'S' ? PDHOST_LAYER_KIND_SLIDING : PDHOST_LAYER_KIND_FULL;
        l->kv_heads = (uint32_t)kv_heads;
        l->head_dim = (uint32_t)head_dim;
        l->window = *p == 'S' ? (uint32_t)window : 0;
        l->state_elems = 0;
    }
    free(json);
    if (b->num_layers == 0) {
        set_error(err, err_cap, "config layers: expected at least one layer");
        free(b);
        return PDHOST_STATUS_BAD_CONFIG;
    }
    b->kv_heads = (uint32_t)kv_heads;
    b->head_dim = (uint32_t)head_dim;
    *out = b;
    return PDHOST_STATUS_OK;
}

static uint32_t example_describe(PdhostBackend *b, PdhostDescription *out, char *err, size_t err_cap) {
    /* A producer of an older minor version passes a shorter struct: fill the fields of 1.0, and later
     * ones only where its struct_size covers them. */
    if (b == NULL || out == NULL || out->struct_size < offsetof(PdhostDescription, identity)) {
        set_error(err, err_cap, "describe: null or short description");
        return PDHOST_STATUS_INVALID_ARGUMENT;
    }
    out->layout = PDHOST_LAYOUT_DENSE;
    out->dtype = PDHOST_DTYPE_F32;
    out->num_layers = b->num_layers;
    out->layers = b->layers;
    out->fingerprint = 0; /* let the producer derive it from the layers */
    if (out->struct_size >= offsetof(PdhostDescription, identity) + sizeof out->identity) {
        /* A stand-in has no weights to name; a real backend reports the identity of what it loaded. */
        out->identity = NULL;
    }
    return PDHOST_STATUS_OK;
}

/* The stand-in model: a value in [-1, 1) from the layer, K or V, token, position, head and dim. */
static float kv_value(uint32_t layer, uint32_t kind, uint32_t token, uint64_t pos, uint32_t head, uint32_t dim) {
    uint64_t h = 1469598103934665603ull;
    uint64_t parts[6] = {layer, kind, token, pos, head, dim};
    for (int i = 0; i < 6; i++) {
        h = (h ^ parts[i]) * 1099511628211ull;
    }
    return (float)(h >> 40) / (float)(1u << 23) - 1.0f;
}

/* A call may start past 0 with the request's earlier tokens in `context_ids` (a prefix-cache hit; this table
   leaves `capabilities` NULL, which tells the host it takes such calls). The stand-in's K/V depends on each
   token and its position alone, so it needs nothing from the context. A real backend must attend to it:
   compute or look up the context's K/V, or set PDHOST_CAP_NO_CONTEXT from a `capabilities` function so
   that the host never sends such a call. */
static uint32_t example_prefill(PdhostBackend *b, const PdhostPrefill *request, const PdhostWriter *writer,
                                char *err, size_t err_cap) {
    if (b == NULL || request == NULL || writer == NULL || request->token_ids == NULL || request->n_tokens == 0) {
        set_error(err, err_cap, "prefill: null argument or no tokens");
        return PDHOST_STATUS_INVALID_ARGUMENT;
    }
    if (writer->num_entries != 2 * b->num_layers) {
        set_error(err, err_cap, "prefill: expected two entries (K, V) per layer");
        return PDHOST_STATUS_INVALID_ARGUMENT;
    }
    uint64_t row = (uint64_t)b->kv_heads * b->head_dim;
    for (uint32_t entry = 0; entry < writer->num_entries; entry++) {
        uint8_t *region = NULL;
        uint64_t len = 0;
        uint32_t status = writer->region(writer->ctx, entry, &region, &len);
        if (status != PDHOST_STATUS_OK) {
            /* The writer's code says why it refused; this function's own status is that it did. */
            char message[96];
            snprintf(message, sizeof message, "prefill: the producer refused region %u (status %u)", entry, status);
            set_error(err, err_cap, message);
            return PDHOST_STATUS_WRITER_REFUSED;
        }
        if (len != request->n_tokens * row * sizeof(float)) {
            set_error(err, err_cap, "prefill: region length is not tokens x kv_heads x head_dim x 4");
            return PDHOST_STATUS_WRITER_REFUSED;
        }
        uint32_t layer = entry / 2, kind = entry % 2;
        for (uint64_t t = 0; t < request->n_tokens; t++) {
            for (uint32_t h = 0; h < b->kv_heads; h++) {
                for (uint32_t d = 0; d < b->head_dim; d++) {
                    float v = kv_value(layer, kind, request->token_ids[t], request->start_pos + t, h, d);
                    /* The region is not aligned for float: copy bytes (little-endian hosts only). */
                    memcpy(region + ((t * b->kv_heads + h) * b->head_dim + d) * sizeof v, &v, sizeof v);
                }
            }
        }
    }
    return PDHOST_STATUS_OK;
}

/* The end of a request (1.2): this backend keeps nothing per request, so there is nothing to free. A
 * backend that keeps earlier chunks' K/V for chunked prefill frees them here. */
static void example_release(PdhostBackend *b, uint64_t request_id) {
    (void)b;
    (void)request_id;
}

static void example_close(PdhostBackend *b) {
    free(b);
}

static const PdhostBackendV1 TABLE = {
    .abi_major = PDHOST_ABI_MAJOR,
    .abi_minor = PDHOST_ABI_MINOR,
    .struct_size = sizeof(PdhostBackendV1),
    .reserved = 0,
    .name = "example-c",
    .open = example_open,
    .describe = example_describe,
    .prefill = example_prefill,
    .close = example_close,
    .release = example_release,
    /* .capabilities, .set_log and .stage stay NULL: no limits beyond the description, no logging, and each
       prefill computes its own chunk. A device that runs several requests' chunks in one pass sets .stage
       (1.3): it computes a batch's chunks and keeps them, and the prefill calls that follow only write
       (docs/plugin-abi.md, "Lifecycle", step 8). */
};

const PdhostBackendV1 *pdhost_backend_v1(void) {
    return &TABLE;
}
