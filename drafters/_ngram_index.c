/* One request's n-gram index for prompt lookup, in C: the hot path of the ``ngram`` drafter's private pools.
 *
 * It is the pure-Python ``NgramPool`` (drafters/ngram.py) specialised to one sequence and chain lookups, and
 * answers exactly as that pool does (tests/test_ngram_native.py compares them on random histories and rewinds).
 *
 * State: the index's own copy of the history (``tok``) and a hash table of n-grams (n in [min_n, max_n]). A
 * *sighting* of n-gram g at position p means tok[p - n:p] == g and p < len (a token follows, so every sighting
 * has a continuation, tok[p:]). Per n-gram the table keeps its oldest and newest sighting; ``prev`` links each
 * sighting to the one before it of the same n-gram, so dropping the newest (a rewind drops positions newest
 * first) restores the one before in O(1).
 *
 * The table is open addressing with linear probing; an entry is found by its hash and n and confirmed by
 * comparing the n tokens before its oldest sighting (the entry stores no tokens of its own). Deletion shifts the
 * following entries back (no tombstones), so a long-lived index never degrades.
 *
 * Cost per decode step: O(new tokens x (max_n - min_n + 1)) table operations to index, at most
 * max_n - min_n + 1 probes to look up, and a compare of the last 64 tokens to check a history list seen before.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <string.h>

#define MAX_N 1024      /* the longest n-gram an index takes (longer ones: NgramPool) */
#define TAIL_CHECK 64  /* tokens of a history list seen before compared with the copy (as LookupState does) */

typedef struct {
    int32_t oldest;  /* first sighting (also where the entry's tokens are read when comparing) */
    int32_t newest;  /* last sighting */
    uint32_t hash;
    int32_t n;       /* 0: an empty slot */
} Entry;

typedef struct {
    PyObject_HEAD
    int min_n, max_n, span;  /* span = max_n - min_n + 1 */
    int use_newest;          /* propose the newest sighting's continuation (else the oldest's) */
    int32_t *tok;            /* the copy of the history */
    int32_t *prev;           /* prev[pos * span + n - min_n]: the sighting before this one (-1: none) */
    Py_ssize_t len, cap;
    Entry *slots;
    size_t mask, used;       /* slots: mask + 1, a power of two, at most half full */
    PyObject *source;        /* the history list synced last (its identity allows the short check) */
} NgramIndex;

static uint32_t hash_gram(const int32_t *g, int n) {
    uint64_t h = 0x9E3779B97F4A7C15ull ^ (uint64_t)n;
    for (int i = 0; i < n; i++) {
        h ^= (uint32_t)g[i];
        h *= 0xFF51AFD7ED558CCDull;
        h ^= h >> 29;
    }
    return (uint32_t)(h ^ (h >> 32));
}

/* The slot holding n-gram g (*found = 1) or the empty slot where it would go (*found = 0). */
static size_t probe(const NgramIndex *s, const int32_t *g, int n, uint32_t h, int *found) {
    size_t i = h & s->mask;
    for (;;) {
        const Entry *e = &s->slots[i];
        if (e->n == 0) {
            *found = 0;
            return i;
        }
        if (e->hash == h && e->n == n && memcmp(s->tok + e->oldest - n, g, (size_t)n * sizeof(int32_t)) == 0) {
            *found = 1;
            return i;
        }
        i = (i + 1) & s->mask;
    }
}

static int grow_table(NgramIndex *s) {
    size_t size = (s->mask + 1) * 2;
    Entry *slots = PyMem_Calloc(size, sizeof(Entry));
    if (slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    for (size_t i = 0; i <= s->mask; i++) {
        Entry *e = &s->slots[i];
        if (e->n == 0)
            continue;
        size_t j = e->hash & (size - 1);
        while (slots[j].n != 0)
            j = (j + 1) & (size - 1);
        slots[j] = *e;
    }
    PyMem_Free(s->slots);
    s->slots = slots;
    s->mask = size - 1;
    return 0;
}

/* Remove slot i, shifting back the entries after it that would no longer be reachable. */
static void delete_slot(NgramIndex *s, size_t i) {
    size_t j = i;
    for (;;) {
        j = (j + 1) & s->mask;
        if (s->slots[j].n == 0)
            break;
        size_t home = s->slots[j].hash & s->mask;
        /* the entry at j stays where it is when its home lies cyclically in (i, j] */
        int stays = i <= j ? (i < home && home <= j) : (i < home || home <= j);
        if (!stays) {
            s->slots[i] = s->slots[j];
            i = j;
        }
    }
    s->slots[i].n = 0;
    s->used--;
}

static int reserve(NgramIndex *s, Py_ssize_t need) {
    if (need <= s->cap)
        return 0;
    Py_ssize_t cap = s->cap * 2 > need ? s->cap * 2 : need;
    int32_t *tok = PyMem_Realloc(s->tok, (size_t)cap * sizeof(int32_t));
    if (tok == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->tok = tok;
    int32_t *prev = PyMem_Realloc(s->prev, (size_t)cap * s->span * sizeof(int32_t));
    if (prev == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->prev = prev;
    s->cap = cap;
    return 0;
}

/* Record the sightings at positions [lo, len), position-major (each n-gram's sightings in text order). */
static int index_from(NgramIndex *s, Py_ssize_t lo) {
    if (lo < 1)
        lo = 1;
    for (Py_ssize_t pos = lo; pos < s->len; pos++) {
        int top = pos < s->max_n ? (int)pos : s->max_n;
        for (int n = s->min_n; n <= top; n++) {
            const int32_t *g = s->tok + pos - n;
            uint32_t h = hash_gram(g, n);
            int found;
            size_t i = probe(s, g, n, h, &found);
            int32_t *link = &s->prev[pos * s->span + n - s->min_n];
            if (found) {
                *link = s->slots[i].newest;
                s->slots[i].newest = (int32_t)pos;
                continue;
            }
            *link = -1;
            s->slots[i] = (Entry){(int32_t)pos, (int32_t)pos, h, n};
            if (++s->used * 2 > s->mask + 1 && grow_table(s) < 0)
                return -1;
        }
    }
    return 0;
}

/* Drop the sightings at positions [keep, len), newest first, and cut the copy to ``keep`` tokens. */
static void truncate_to(NgramIndex *s, Py_ssize_t keep) {
    Py_ssize_t lo = keep < 1 ? 1 : keep;
    for (Py_ssize_t pos = s->len - 1; pos >= lo; pos--) {
        int top = pos < s->max_n ? (int)pos : s->max_n;
        for (int n = top; n >= s->min_n; n--) {
            const int32_t *g = s->tok + pos - n;
            int found;
            size_t i = probe(s, g, n, hash_gram(g, n), &found);
            assert(found && s->slots[i].newest == pos);
            int32_t before = s->prev[pos * s->span + n - s->min_n];
            if (before >= 0)
                s->slots[i].newest = before;
            else
                delete_slot(s, i);
        }
    }
    s->len = keep;
}

static int token_of(PyObject *item, int32_t *out) {
    if (!PyLong_Check(item)) {  /* an int's value is read without running Python code (the list stays put) */
        PyErr_Format(PyExc_TypeError, "token ids must be ints, not %.100s", Py_TYPE(item)->tp_name);
        return -1;
    }
    long v = PyLong_AsLong(item);
    if (v == -1 && PyErr_Occurred())
        return -1;
    if (v < 0 || v > INT32_MAX) {
        PyErr_Format(PyExc_ValueError, "token id %ld is outside [0, 2**31): the n-gram index holds int32 ids", v);
        return -1;
    }
    *out = (int32_t)v;
    return 0;
}

/* How many leading tokens of the copy ``items`` (n of them) still holds. */
static Py_ssize_t still_holds(NgramIndex *s, PyObject **items, Py_ssize_t n, int same_list) {
    Py_ssize_t limit = n < s->len ? n : s->len;
    Py_ssize_t lo = 0;
    if (same_list && n >= s->len)  /* grown by appends, unless its last tokens were changed in place */
        lo = s->len > TAIL_CHECK ? s->len - TAIL_CHECK : 0;
    for (Py_ssize_t i = lo; i < limit; i++) {
        int32_t t;
        if (token_of(items[i], &t) < 0)
            return -1;
        if (t != s->tok[i])
            return i;
    }
    return limit;
}

static PyObject *NgramIndex_sync(NgramIndex *s, PyObject *history) {
    PyObject *seq = PySequence_Fast(history, "history must be a sequence of token ids");
    if (seq == NULL)
        return NULL;
    Py_ssize_t n = PySequence_Fast_GET_SIZE(seq);
    PyObject **items = PySequence_Fast_ITEMS(seq);
    Py_ssize_t kept = still_holds(s, items, n, history == s->source);
    if (kept < 0 || reserve(s, n) < 0)
        goto fail;
    Py_ssize_t dropped = s->len - kept;
    if (dropped > 0)
        truncate_to(s, kept);
    for (Py_ssize_t i = kept; i < n; i++)  /* converted first: a bad id leaves the copy at history[:kept] */
        if (token_of(items[i], &s->tok[i]) < 0)
            goto fail;
    s->len = n;
    if (index_from(s, kept) < 0)
        goto fail;
    Py_DECREF(seq);
    Py_INCREF(history);
    Py_XSETREF(s->source, history);
    return PyLong_FromSsize_t(dropped);
fail:
    Py_DECREF(seq);
    Py_CLEAR(s->source);  /* check the whole history next time */
    return NULL;
}

static PyObject *NgramIndex_lookup(NgramIndex *s, PyObject *arg) {
    Py_ssize_t k = PyLong_AsSsize_t(arg);
    if (k == -1 && PyErr_Occurred())
        return NULL;
    int top = s->len < s->max_n ? (int)s->len : s->max_n;
    for (int n = top; k > 0 && n >= s->min_n; n--) {
        const int32_t *g = s->tok + s->len - n;
        int found;
        size_t i = probe(s, g, n, hash_gram(g, n), &found);
        if (!found)
            continue;
        Py_ssize_t pos = s->use_newest ? s->slots[i].newest : s->slots[i].oldest;
        Py_ssize_t count = s->len - pos < k ? s->len - pos : k;
        PyObject *tokens = PyList_New(count);
        if (tokens == NULL)
            return NULL;
        for (Py_ssize_t j = 0; j < count; j++) {
            PyObject *t = PyLong_FromLong(s->tok[pos + j]);
            if (t == NULL) {
                Py_DECREF(tokens);
                return NULL;
            }
            PyList_SET_ITEM(tokens, j, t);
        }
        return Py_BuildValue("(Ni)", tokens, n);
    }
    return Py_BuildValue("([]i)", 0);
}

static PyObject *NgramIndex_tokens(NgramIndex *s, PyObject *Py_UNUSED(ignored)) {
    PyObject *tokens = PyList_New(s->len);
    if (tokens == NULL)
        return NULL;
    for (Py_ssize_t j = 0; j < s->len; j++) {
        PyObject *t = PyLong_FromLong(s->tok[j]);
        if (t == NULL) {
            Py_DECREF(tokens);
            return NULL;
        }
        PyList_SET_ITEM(tokens, j, t);
    }
    return tokens;
}

static PyObject *NgramIndex_num_ngrams(NgramIndex *s, void *Py_UNUSED(closure)) {
    return PyLong_FromSize_t(s->used);
}

static Py_ssize_t NgramIndex_len(NgramIndex *s) {
    return s->len;
}

static int NgramIndex_init(NgramIndex *s, PyObject *args, PyObject *kwargs) {
    static char *names[] = {"prompt_lookup_min", "prompt_lookup_max", "use_newest", NULL};
    int min_n, max_n, use_newest;
    if (!PyArg_ParseTupleAndKeywords(args, kwargs, "iip", names, &min_n, &max_n, &use_newest))
        return -1;
    if (min_n < 1 || max_n < min_n || max_n > MAX_N) {
        PyErr_Format(PyExc_ValueError, "prompt_lookup_min=%d and prompt_lookup_max=%d must satisfy "
                     "1 <= min <= max <= %d", min_n, max_n, MAX_N);
        return -1;
    }
    if (s->slots != NULL) {
        PyErr_SetString(PyExc_RuntimeError, "an NgramIndex is initialised once");
        return -1;
    }
    s->min_n = min_n;
    s->max_n = max_n;
    s->span = max_n - min_n + 1;
    s->use_newest = use_newest;
    s->slots = PyMem_Calloc(64, sizeof(Entry));
    if (s->slots == NULL) {
        PyErr_NoMemory();
        return -1;
    }
    s->mask = 63;
    return reserve(s, 256);
}

static void NgramIndex_dealloc(NgramIndex *s) {
    PyMem_Free(s->tok);
    PyMem_Free(s->prev);
    PyMem_Free(s->slots);
    Py_XDECREF(s->source);
    Py_TYPE(s)->tp_free((PyObject *)s);
}

static PyMethodDef NgramIndex_methods[] = {
    {"sync", (PyCFunction)NgramIndex_sync, METH_O,
     "sync(history) -> dropped: make the copy read ``history`` (indexing what is new); returns how many tokens "
     "of the old copy no longer held (0 unless the history was rewound)."},
    {"lookup", (PyCFunction)NgramIndex_lookup, METH_O,
     "lookup(k) -> (tokens, n): up to k tokens that followed the longest n-gram ending the history "
     "(n from max down to min; ([], 0) with no match)."},
    {"tokens", (PyCFunction)NgramIndex_tokens, METH_NOARGS, "The copy of the history, as a new list."},
    {NULL, NULL, 0, NULL},
};

static PyGetSetDef NgramIndex_getset[] = {
    {"num_ngrams", (getter)NgramIndex_num_ngrams, NULL, "Distinct n-grams indexed.", NULL},
    {NULL, NULL, NULL, NULL, NULL},
};

static PySequenceMethods NgramIndex_as_sequence = {.sq_length = (lenfunc)NgramIndex_len};

static PyTypeObject NgramIndexType = {
    PyVarObject_HEAD_INIT(NULL, 0)
    .tp_name = "specray.drafters._ngram_index.NgramIndex",
    .tp_doc = "NgramIndex(prompt_lookup_min, prompt_lookup_max, use_newest): one sequence's n-gram index.",
    .tp_basicsize = sizeof(NgramIndex),
    .tp_flags = Py_TPFLAGS_DEFAULT,
    .tp_new = PyType_GenericNew,
    .tp_init = (initproc)NgramIndex_init,
    .tp_dealloc = (destructor)NgramIndex_dealloc,
    .tp_methods = NgramIndex_methods,
    .tp_getset = NgramIndex_getset,
    .tp_as_sequence = &NgramIndex_as_sequence,
};

static struct PyModuleDef module = {
    PyModuleDef_HEAD_INIT,
    .m_name = "specray.drafters._ngram_index",
    .m_doc = "The ngram drafter's per-request n-gram index in C (see drafters/ngram.py for the semantics).",
    .m_size = -1,
};

PyMODINIT_FUNC PyInit__ngram_index(void) {
    if (PyType_Ready(&NgramIndexType) < 0)
        return NULL;
    PyObject *m = PyModule_Create(&module);
    if (m == NULL)
        return NULL;
    if (PyModule_AddIntConstant(m, "MAX_N", MAX_N) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    Py_INCREF(&NgramIndexType);
    if (PyModule_AddObject(m, "NgramIndex", (PyObject *)&NgramIndexType) < 0) {
        Py_DECREF(&NgramIndexType);
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
