/* dedupe_worker._kafka_records: the Kafka consumer's identification of plain records, compiled.
 *
 * What is guaranteed: plain_identities(messages, fingerprint, ttl_lowered) answers, for each record
 * it takes, the key and fingerprint DedupeKafkaConsumer's pure-Python path gives it with the
 * default key strategy and fingerprint (kafka/_consumer.py, _identify_one), and no ttl; every other
 * record it leaves to that path (key None), which answers or raises as it always did. A record is
 * taken when:
 *
 *   headers()  returns a list or tuple of 2-tuples whose names are str (a dict, as a test's
 *              Message may hold, or anything else: left)
 *   key        the last header named exactly "idempotency-key" (dict(headers).get) is non-empty
 *              bytes: decoded as UTF-8 with backslashreplace, as default_header_key() decodes it
 *              (no such header, None or empty: left, for the rest of the key strategy's chain)
 *   ttl        ttl_lowered is None (no ttl header read), or no header name is that name in any
 *              case (while it is read, a name that is not ASCII: left, Unicode case folding
 *              is Python's to do)
 *   value()    None or bytes: the fingerprint is sha256(value or b"").hexdigest()[:32], as
 *              bytes_fingerprint() gives it (fingerprint False: no fingerprint, None; a str
 *              value: left)
 *
 * A headers() or value() call that raises, or a hash that fails, leaves the record too (the
 * Python path calls them again, and reports what they raise as the record's failure).
 *
 * The digest: built with DEDUPE_OPENSSL (hatch_build.py, where OpenSSL's headers and libcrypto
 * are found), OpenSSL's EVP interface computes it on the value's bytes, one context a call reused
 * for every record; without it, or where SHA-256 cannot be fetched from OpenSSL at import,
 * hashlib.sha256 does (DIGEST says which). Both give SHA-256, so the fingerprint is the same.
 *
 * Why: the pure-Python identification is about 130 bytecodes a record (a dict of its headers,
 * two look-ups, a decode, a hash and a hex digest sliced, the ttl header's search), a third of
 * what a duplicate costs the consumer; here it is the calls into confluent-kafka and a loop over
 * the header tuples. The digest through hashlib costs ~280 ns a 13-byte body (a hash object, two
 * EVP contexts allocated and wiped, a digest bytes object); through EVP with one context, ~70 ns
 * (bench.kafka_cpu, pinned).
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <string.h>
#ifdef DEDUPE_OPENSSL
#include <openssl/evp.h>
#endif

#define KEY_HEADER "idempotency-key"
#define KEY_HEADER_LEN 15
#define FINGERPRINT_HEX 32  /* hexdigest()[:32]: the first 16 bytes of the digest */
#define GIL_MINSIZE 2048    /* a body at least this long is hashed with the GIL released, as hashlib does */

typedef struct {
    PyObject *headers_name;  /* "headers" */
    PyObject *value_name;    /* "value" */
    PyObject *digest_name;   /* "digest" */
    PyObject *sha256;        /* hashlib.sha256: NULL while OpenSSL computes the digest */
#ifdef DEDUPE_OPENSSL
    EVP_MD *md;              /* SHA-256, fetched once at import (NULL: hashlib computes it) */
#endif
} State;

/* A call's digest context, reused record after record: OpenSSL's, or NULL where hashlib computes. */
#ifdef DEDUPE_OPENSSL
typedef EVP_MD_CTX Context;
#else
typedef void Context;
#endif

/* Whether the ASCII str name equals lowered (ASCII) in any case. */
static int
ascii_equal_folded(PyObject *name, const char *lowered, Py_ssize_t length)
{
    if (PyUnicode_GET_LENGTH(name) != length)
        return 0;
    const unsigned char *data = (const unsigned char *)PyUnicode_DATA(name);
    for (Py_ssize_t i = 0; i < length; i++) {
        unsigned char c = data[i];
        if (c >= 'A' && c <= 'Z')
            c = (unsigned char)(c + ('a' - 'A'));
        if (c != (unsigned char)lowered[i])
            return 0;
    }
    return 1;
}

/* The record's key (a new reference), or NULL with no error set when the record is left to the
 * Python path. ttl_lowered NULL: no ttl header is read. */
static PyObject *
plain_key(State *state, PyObject *message, const char *ttl_lowered, Py_ssize_t ttl_length, int ttl_ascii)
{
    PyObject *headers = PyObject_CallMethodNoArgs(message, state->headers_name);
    if (headers == NULL) {
        PyErr_Clear();
        return NULL;
    }
    PyObject *found = NULL;  /* borrowed from headers */
    int taken = PyList_CheckExact(headers) || PyTuple_CheckExact(headers);
    Py_ssize_t count = taken ? PySequence_Fast_GET_SIZE(headers) : 0;
    PyObject **items = taken ? PySequence_Fast_ITEMS(headers) : NULL;
    for (Py_ssize_t i = 0; taken && i < count; i++) {
        PyObject *pair = items[i];
        if (!PyTuple_CheckExact(pair) || PyTuple_GET_SIZE(pair) != 2) {
            taken = 0;
            break;
        }
        PyObject *name = PyTuple_GET_ITEM(pair, 0);
        if (!PyUnicode_CheckExact(name)) {
            taken = 0;
            break;
        }
        int ascii = PyUnicode_IS_ASCII(name);
        if (ascii && PyUnicode_GET_LENGTH(name) == KEY_HEADER_LEN
                && memcmp(PyUnicode_DATA(name), KEY_HEADER, KEY_HEADER_LEN) == 0)
            found = PyTuple_GET_ITEM(pair, 1);  /* the last one wins, as in dict(headers) */
        if (ttl_lowered != NULL
                && (!ascii || (ttl_ascii && ascii_equal_folded(name, ttl_lowered, ttl_length)))) {
            taken = 0;  /* a ttl to parse, or a name whose lower() is Python's to say */
            break;
        }
    }
    PyObject *key = NULL;
    if (taken && found != NULL && PyBytes_CheckExact(found) && PyBytes_GET_SIZE(found) > 0) {
        key = PyUnicode_DecodeUTF8(PyBytes_AS_STRING(found), PyBytes_GET_SIZE(found), "backslashreplace");
        if (key == NULL)
            PyErr_Clear();
    }
    Py_DECREF(headers);
    return key;
}

static const char HEX[] = "0123456789abcdef";

#ifdef DEDUPE_OPENSSL
/* The SHA-256 of size bytes into full (length set); 1, or 0 when OpenSSL failed. */
static int
evp_digest(Context *context, const EVP_MD *md, const char *bytes, size_t size, unsigned char *full,
           unsigned int *length)
{
    return EVP_DigestInit_ex(context, md, NULL) && EVP_DigestUpdate(context, bytes, size)
           && EVP_DigestFinal_ex(context, full, length);
}
#endif

/* The first FINGERPRINT_HEX / 2 bytes of the SHA-256 of data into out; 0, or -1 with no error
 * set when the record is left to the Python path. */
static int
digest_into(State *state, Context *context, PyObject *data, unsigned char *out)
{
#ifdef DEDUPE_OPENSSL
    if (context != NULL) {
        unsigned char full[EVP_MAX_MD_SIZE];
        unsigned int length = 0;
        const char *bytes = PyBytes_AS_STRING(data);  /* data is ours (a reference) while unlocked */
        size_t size = (size_t)PyBytes_GET_SIZE(data);
        int ok;
        if (size >= GIL_MINSIZE) {
            Py_BEGIN_ALLOW_THREADS
            ok = evp_digest(context, state->md, bytes, size, full, &length);
            Py_END_ALLOW_THREADS
        }
        else {
            ok = evp_digest(context, state->md, bytes, size, full, &length);
        }
        if (!ok || length < FINGERPRINT_HEX / 2)
            return -1;
        memcpy(out, full, FINGERPRINT_HEX / 2);
        return 0;
    }
#endif
    PyObject *hash = PyObject_CallOneArg(state->sha256, data);
    if (hash == NULL) {
        PyErr_Clear();
        return -1;
    }
    PyObject *digest = PyObject_CallMethodNoArgs(hash, state->digest_name);
    Py_DECREF(hash);
    if (digest == NULL || !PyBytes_CheckExact(digest) || PyBytes_GET_SIZE(digest) < FINGERPRINT_HEX / 2) {
        PyErr_Clear();
        Py_XDECREF(digest);
        return -1;
    }
    memcpy(out, PyBytes_AS_STRING(digest), FINGERPRINT_HEX / 2);
    Py_DECREF(digest);
    return 0;
}

/* sha256(value or b"").hexdigest()[:32] of the record (a new reference), or NULL with no error
 * set when the record is left to the Python path. */
static PyObject *
plain_fingerprint(State *state, Context *context, PyObject *message)
{
    PyObject *value = PyObject_CallMethodNoArgs(message, state->value_name);
    if (value == NULL) {
        PyErr_Clear();
        return NULL;
    }
    if (value == Py_None) {
        Py_DECREF(value);
        value = PyBytes_FromStringAndSize(NULL, 0);
        if (value == NULL) {
            PyErr_Clear();
            return NULL;
        }
    }
    else if (!PyBytes_CheckExact(value)) {
        Py_DECREF(value);
        return NULL;
    }
    unsigned char bytes[FINGERPRINT_HEX / 2];
    int failed = digest_into(state, context, value, bytes);
    Py_DECREF(value);
    if (failed)
        return NULL;
    PyObject *text = PyUnicode_New(FINGERPRINT_HEX, 127);
    if (text == NULL) {
        PyErr_Clear();
        return NULL;
    }
    Py_UCS1 *out = PyUnicode_1BYTE_DATA(text);
    for (int i = 0; i < FINGERPRINT_HEX / 2; i++) {
        out[2 * i] = (Py_UCS1)HEX[bytes[i] >> 4];
        out[2 * i + 1] = (Py_UCS1)HEX[bytes[i] & 15];
    }
    return text;
}

static PyObject *
plain_identities(PyObject *module, PyObject *const *args, Py_ssize_t nargs)
{
    if (nargs != 3) {
        PyErr_Format(PyExc_TypeError, "plain_identities() takes 3 arguments (%zd given)", nargs);
        return NULL;
    }
    State *state = (State *)PyModule_GetState(module);
    PyObject *messages = args[0], *ttl = args[2];
    if (!PyBool_Check(args[1])) {
        PyErr_SetString(PyExc_TypeError, "fingerprint must be True or False");
        return NULL;
    }
    int fingerprinted = args[1] == Py_True;
    const char *ttl_lowered = NULL;
    Py_ssize_t ttl_length = 0;
    int ttl_ascii = 0;
    if (ttl != Py_None) {
        if (!PyUnicode_Check(ttl)) {
            PyErr_SetString(PyExc_TypeError, "ttl_lowered must be a str or None");
            return NULL;
        }
        /* A name that is not ASCII equals no ASCII name in any case; names that are not ASCII
         * are left to the Python path anyway. */
        ttl_ascii = PyUnicode_IS_ASCII(ttl);
        ttl_lowered = ttl_ascii ? (const char *)PyUnicode_DATA(ttl) : "";
        ttl_length = PyUnicode_GET_LENGTH(ttl);
    }
    /* A tuple of its own: a method of a record may run Python code, which could change the
     * caller's list under the loop (each record is kept alive by the tuple too). */
    PyObject *sequence = PySequence_Tuple(messages);
    if (sequence == NULL)
        return NULL;
    Py_ssize_t count = PyTuple_GET_SIZE(sequence);
    PyObject *keys = PyList_New(count);
    PyObject *fingerprints = PyList_New(count);
    Context *context = NULL;
    if (keys == NULL || fingerprints == NULL)
        goto error;
#ifdef DEDUPE_OPENSSL
    if (fingerprinted && state->md != NULL && (context = EVP_MD_CTX_new()) == NULL) {
        PyErr_NoMemory();
        goto error;
    }
#endif
    for (Py_ssize_t i = 0; i < count; i++) {
        PyObject *message = PyTuple_GET_ITEM(sequence, i);
        PyObject *key = plain_key(state, message, ttl_lowered, ttl_length, ttl_ascii);
        PyObject *fingerprint = Py_None;
        if (key != NULL && fingerprinted) {
            fingerprint = plain_fingerprint(state, context, message);
            if (fingerprint == NULL)
                Py_CLEAR(key);
        }
        if (key == NULL) {  /* left to the Python path */
            key = Py_NewRef(Py_None);
            fingerprint = Py_None;
        }
        PyList_SET_ITEM(keys, i, key);
        PyList_SET_ITEM(fingerprints, i, fingerprint == Py_None ? Py_NewRef(Py_None) : fingerprint);
    }
    Py_DECREF(sequence);
#ifdef DEDUPE_OPENSSL
    EVP_MD_CTX_free(context);
#endif
    PyObject *result = PyTuple_Pack(2, keys, fingerprints);
    Py_DECREF(keys);
    Py_DECREF(fingerprints);
    return result;

error:
    Py_DECREF(sequence);
#ifdef DEDUPE_OPENSSL
    EVP_MD_CTX_free(context);
#endif
    Py_XDECREF(keys);
    Py_XDECREF(fingerprints);
    return NULL;
}

PyDoc_STRVAR(plain_identities_doc,
"plain_identities(messages, fingerprint, ttl_lowered, /)\n--\n\n"
"(keys, fingerprints) of confluent-kafka records with the default key strategy and body\n"
"fingerprint (fingerprint False: none, None; ttl_lowered: the ttl header's name lower-cased,\n"
"or None when it is not read). A key None: the record is the Python path's\n"
"(see the module's documentation).");

static PyMethodDef methods[] = {
    {"plain_identities", (PyCFunction)(void (*)(void))plain_identities, METH_FASTCALL, plain_identities_doc},
    {NULL, NULL, 0, NULL},
};

static int
exec_module(PyObject *module)
{
    State *state = (State *)PyModule_GetState(module);
    state->headers_name = PyUnicode_InternFromString("headers");
    state->value_name = PyUnicode_InternFromString("value");
    state->digest_name = PyUnicode_InternFromString("digest");
    if (state->headers_name == NULL || state->value_name == NULL || state->digest_name == NULL)
        return -1;
    int openssl = 0;  /* whether OpenSSL computes the digests */
#ifdef DEDUPE_OPENSSL
#if OPENSSL_VERSION_NUMBER >= 0x30000000L
    state->md = EVP_MD_fetch(NULL, "SHA256", NULL);  /* fetched once: EVP_sha256() is fetched at each init */
#else
    state->md = (EVP_MD *)EVP_sha256();
#endif
    openssl = state->md != NULL;
#endif
    if (!openssl) {
        PyObject *hashlib = PyImport_ImportModule("hashlib");
        if (hashlib == NULL)
            return -1;
        state->sha256 = PyObject_GetAttrString(hashlib, "sha256");
        Py_DECREF(hashlib);
        if (state->sha256 == NULL)
            return -1;
    }
    return PyModule_AddStringConstant(module, "DIGEST", openssl ? "openssl" : "hashlib");
}

static int
traverse(PyObject *module, visitproc visit, void *arg)
{
    State *state = (State *)PyModule_GetState(module);
    if (state != NULL)
        Py_VISIT(state->sha256);
    return 0;
}

static int
clear(PyObject *module)
{
    State *state = (State *)PyModule_GetState(module);
    if (state != NULL) {
        Py_CLEAR(state->headers_name);
        Py_CLEAR(state->value_name);
        Py_CLEAR(state->digest_name);
        Py_CLEAR(state->sha256);
#if defined(DEDUPE_OPENSSL) && OPENSSL_VERSION_NUMBER >= 0x30000000L
        EVP_MD_free(state->md);
#endif
#ifdef DEDUPE_OPENSSL
        state->md = NULL;
#endif
    }
    return 0;
}

static void
free_module(void *module)
{
    clear((PyObject *)module);
}

static PyModuleDef_Slot slots[] = {
    {Py_mod_exec, exec_module},
#ifdef Py_mod_multiple_interpreters
    {Py_mod_multiple_interpreters, Py_MOD_PER_INTERPRETER_GIL_SUPPORTED},
#endif
#ifdef Py_mod_gil
    {Py_mod_gil, Py_MOD_GIL_NOT_USED},
#endif
    {0, NULL},
};

PyDoc_STRVAR(module_doc,
"The Kafka consumer's identification of plain records (default key header, body fingerprint),\n"
"compiled; the records it does not take are left to the Python path.\n\n"
"Used by dedupe_worker.kafka.DedupeKafkaConsumer; DEDUPE_PURE_PYTHON=1 makes the library ignore it.");

static struct PyModuleDef module_def = {
    PyModuleDef_HEAD_INIT,
    .m_name = "dedupe_worker._kafka_records",
    .m_doc = module_doc,
    .m_size = sizeof(State),
    .m_methods = methods,
    .m_slots = slots,
    .m_traverse = traverse,
    .m_clear = clear,
    .m_free = free_module,
};

PyMODINIT_FUNC
PyInit__kafka_records(void)
{
    return PyModuleDef_Init(&module_def);
}
