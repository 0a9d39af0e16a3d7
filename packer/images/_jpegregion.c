/* Region decode of a JPEG through libjpeg's API (libjpeg-turbo >= 1.5): decode only the rows and columns a
 * crop needs, at a DCT scale, straight into a caller's RGB buffer. Used by packer.images.jpegregion.
 *
 * decode_region(data, denom, top, left, out, strict, max_pixels, whole=False) -> bool
 *   data: the JPEG bytes (any buffer); denom: 1, 2, 4 or 8 (the DCT scale 1/denom); top, left: the region's
 *   corner on the 1/denom grid; out: a writable C-contiguous uint8 buffer of shape (h, w, 3): the region's
 *   size; whole: out must be the whole image at 1/denom (top, left 0). Returns False (nothing written) for
 *   CMYK/YCCK JPEGs, which the caller decodes another way, and (whole) when out is not the image's size.
 *   Raises ValueError for corrupt data (and, when strict, for libjpeg's warnings such as truncated data),
 *   for an image above max_pixels (0: no limit) and for a region outside the scaled image.
 *
 * Columns: jpeg_crop_scanline (widened to iMCU boundaries by libjpeg, and by one pixel each side here so
 * that fancy upsampling sees the same neighbours as a full decode). Rows: jpeg_skip_scanlines above, stop
 * after the last one needed. Rows as wide as the region (a whole image) are decoded straight into out.
 * libjpeg's error_exit longjmps back here, never exits the process. The GIL is released while libjpeg runs.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>

struct region_error {
    struct jpeg_error_mgr pub;
    jmp_buf jump;
    int strict;
    char message[JMSG_LENGTH_MAX];
};

static void on_error(j_common_ptr cinfo) {
    struct region_error *err = (struct region_error *)cinfo->err;
    (*cinfo->err->format_message)(cinfo, err->message);
    longjmp(err->jump, 1);
}

static void on_message(j_common_ptr cinfo, int level) {
    struct region_error *err = (struct region_error *)cinfo->err;
    if (level < 0) { /* a warning: corrupt or truncated data that libjpeg would paper over */
        cinfo->err->num_warnings++;
        if (err->strict) {
            (*cinfo->err->format_message)(cinfo, err->message);
            longjmp(err->jump, 1);
        }
    }
}

static void on_output(j_common_ptr cinfo) { (void)cinfo; } /* never print to stderr */

/* The decode itself, without the GIL. Returns 1 done, 0 unsupported colour space or (whole) not the image's
 * size, -1 error (message set). */
static int decode(const unsigned char *data, size_t size, int denom, JDIMENSION top, JDIMENSION left,
                  JDIMENSION height, JDIMENSION width, unsigned char *out, int strict, unsigned long long max_pixels,
                  int whole, char *message) {
    struct jpeg_decompress_struct cinfo;
    struct region_error err;
    unsigned char *volatile row = NULL;
    int result = -1;

    memset(&cinfo, 0, sizeof(cinfo));
    cinfo.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.pub.output_message = on_output;
    err.strict = strict;
    err.message[0] = '\0';
    if (setjmp(err.jump)) {
        snprintf(message, JMSG_LENGTH_MAX, "%s", err.message[0] ? err.message : "libjpeg error");
        jpeg_destroy_decompress(&cinfo);
        free(row);
        return -1;
    }
    jpeg_create_decompress(&cinfo);
    jpeg_mem_src(&cinfo, data, (unsigned long)size);
    jpeg_read_header(&cinfo, TRUE);
    if (max_pixels && (unsigned long long)cinfo.image_width * cinfo.image_height > max_pixels) {
        snprintf(message, JMSG_LENGTH_MAX, "image header says %ux%u, above the pixel limit of %llu",
                 cinfo.image_height, cinfo.image_width, max_pixels);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK) {
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    cinfo.out_color_space = JCS_RGB;
    cinfo.scale_num = 1;
    cinfo.scale_denom = (unsigned int)denom;
    jpeg_calc_output_dimensions(&cinfo);
    if (whole && (top != 0 || left != 0 || height != cinfo.output_height || width != cinfo.output_width)) {
        jpeg_destroy_decompress(&cinfo);
        return 0;
    }
    if (height == 0 || width == 0 || top >= cinfo.output_height || height > cinfo.output_height - top ||
        left >= cinfo.output_width || width > cinfo.output_width - left) {
        snprintf(message, JMSG_LENGTH_MAX, "region %ux%u at (%u, %u) outside the %ux%u image at 1/%d",
                 height, width, top, left, cinfo.output_height, cinfo.output_width, denom);
        jpeg_destroy_decompress(&cinfo);
        return -1;
    }
    jpeg_start_decompress(&cinfo);
    {
        /* one guard pixel each side, so the region's edge columns are upsampled with their real neighbours */
        JDIMENSION x0 = left > 0 ? left - 1 : 0;
        JDIMENSION x1 = left + width < cinfo.output_width ? left + width + 1 : cinfo.output_width;
        JDIMENSION xoffset = x0, xwidth = x1 - x0, y;
        if (xoffset > 0 || xwidth < cinfo.output_width)
            jpeg_crop_scanline(&cinfo, &xoffset, &xwidth); /* widened to iMCU boundaries */
        if (top > 0 && jpeg_skip_scanlines(&cinfo, top) != top) {
            snprintf(message, JMSG_LENGTH_MAX, "could not skip %u rows", top);
            goto done;
        }
        if (xoffset == left && cinfo.output_width == width) {
            /* the rows decoded are the region's own (e.g. the whole image): straight into out, no copy */
            JSAMPROW rows[8];
            for (y = 0; y < height;) {
                JDIMENSION n = height - y, k, got;
                if (n > (JDIMENSION)cinfo.rec_outbuf_height) n = (JDIMENSION)cinfo.rec_outbuf_height;
                if (n > 8) n = 8;
                for (k = 0; k < n; k++) rows[k] = out + (size_t)(y + k) * width * 3;
                got = jpeg_read_scanlines(&cinfo, rows, n);
                if (got == 0) {
                    snprintf(message, JMSG_LENGTH_MAX, "no row %u", top + y);
                    goto done;
                }
                y += got;
            }
        } else {
            row = malloc((size_t)cinfo.output_width * 3); /* a decoded row, wider than the region */
            if (row == NULL) {
                snprintf(message, JMSG_LENGTH_MAX, "out of memory");
                goto done;
            }
            for (y = 0; y < height; y++) {
                JSAMPROW rows[1] = {row};
                if (jpeg_read_scanlines(&cinfo, rows, 1) != 1) {
                    snprintf(message, JMSG_LENGTH_MAX, "no row %u", top + y);
                    goto done;
                }
                memcpy(out + (size_t)y * width * 3, row + (size_t)(left - xoffset) * 3, (size_t)width * 3);
            }
        }
        if (top + height == cinfo.output_height)
            jpeg_finish_decompress(&cinfo); /* reads to the end marker, as a whole decode does: errors there count
                                               (and, when strict, warnings such as truncated data) */
        if (strict && cinfo.err->num_warnings > 0) {
            snprintf(message, JMSG_LENGTH_MAX, "corrupt JPEG data");
            goto done;
        }
        result = 1;
    }
done:
    jpeg_destroy_decompress(&cinfo); /* aborts the rest: rows below the region are never decoded */
    free(row);
    return result;
}

static PyObject *decode_region(PyObject *self, PyObject *args) {
    Py_buffer data, out;
    PyObject *out_obj;
    int denom, strict, whole = 0;
    unsigned int top, left;
    unsigned long long max_pixels;
    Py_ssize_t height, width;
    char message[JMSG_LENGTH_MAX];
    int result;
    (void)self;

    if (!PyArg_ParseTuple(args, "y*iIIOpK|p", &data, &denom, &top, &left, &out_obj, &strict, &max_pixels,
                          &whole))
        return NULL;
    if (PyObject_GetBuffer(out_obj, &out, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0) {
        PyBuffer_Release(&data);
        return NULL;
    }
    if (denom != 1 && denom != 2 && denom != 4 && denom != 8) {
        PyErr_Format(PyExc_ValueError, "scale denominator %d: expected 1, 2, 4 or 8", denom);
        goto fail;
    }
    if (out.ndim != 3 || out.shape[2] != 3 || out.itemsize != 1 || strcmp(out.format, "B") != 0) {
        PyErr_SetString(PyExc_ValueError, "out: expected a C-contiguous uint8 buffer of shape (h, w, 3)");
        goto fail;
    }
    height = out.shape[0];
    width = out.shape[1];
    if (height > 0xFFFF || width > 0xFFFF) { /* JPEG's own limit on a side */
        PyErr_SetString(PyExc_ValueError, "out: larger than any JPEG");
        goto fail;
    }
    message[0] = '\0';
    Py_BEGIN_ALLOW_THREADS
    result = decode((const unsigned char *)data.buf, (size_t)data.len, denom, top, left, (JDIMENSION)height,
                    (JDIMENSION)width, (unsigned char *)out.buf, strict, max_pixels, whole, message);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    if (result < 0) {
        PyErr_SetString(PyExc_ValueError, message);
        return NULL;
    }
    return PyBool_FromLong(result);
fail:
    PyBuffer_Release(&data);
    PyBuffer_Release(&out);
    return NULL;
}

/* decode_many(datas, outs, strict, max_pixels) -> bytes: whole JPEGs, datas[k] into outs[k] (writable
 * C-contiguous uint8 buffers of shape (h, w, 3)), all in one call without the GIL. Per item one byte: 1 done,
 * 0 not done (not a JPEG, CMYK/YCCK, out not the header's size or not such a buffer, out above max_pixels),
 * 2 an error (corrupt data, a header above max_pixels). The caller decodes items not done one by one, a path
 * that says what is wrong; out may then hold some rows already. */
static PyObject *decode_many(PyObject *self, PyObject *args) {
    PyObject *datas_obj, *outs_obj, *datas = NULL, *outs = NULL, *status = NULL;
    Py_buffer *bufs = NULL, *dsts = NULL;
    unsigned char *ok = NULL;
    int strict;
    unsigned long long max_pixels;
    Py_ssize_t n = 0, k, got_bufs = 0, got_dsts = 0;
    char message[JMSG_LENGTH_MAX];
    (void)self;

    if (!PyArg_ParseTuple(args, "OOpK", &datas_obj, &outs_obj, &strict, &max_pixels))
        return NULL;
    datas = PySequence_Fast(datas_obj, "datas: expected a sequence of buffers");
    outs = datas == NULL ? NULL : PySequence_Fast(outs_obj, "outs: expected a sequence of buffers");
    if (outs == NULL)
        goto done;
    n = PySequence_Fast_GET_SIZE(datas);
    if (PySequence_Fast_GET_SIZE(outs) != n) {
        PyErr_SetString(PyExc_ValueError, "datas and outs differ in length");
        goto done;
    }
    bufs = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    dsts = PyMem_Calloc((size_t)(n ? n : 1), sizeof(Py_buffer));
    ok = PyMem_Calloc((size_t)(n ? n : 1), 1);
    if (bufs == NULL || dsts == NULL || ok == NULL) {
        PyErr_NoMemory();
        goto done;
    }
    for (k = 0; k < n; k++, got_bufs++)
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(datas, k), &bufs[k], PyBUF_SIMPLE) < 0)
            goto done;
    for (k = 0; k < n; k++, got_dsts++) {
        Py_buffer *d = &dsts[k];
        if (PyObject_GetBuffer(PySequence_Fast_GET_ITEM(outs, k), d, PyBUF_WRITABLE | PyBUF_C_CONTIGUOUS |
                               PyBUF_FORMAT) < 0) {
            PyErr_Clear(); /* read-only, strided or no buffer: not done here (released as empty below) */
            memset(d, 0, sizeof(*d));
            continue;
        }
        /* usable: (h, w, 3) uint8 within JPEG's limit on a side and max_pixels; else left to the caller */
        ok[k] = d->ndim == 3 && d->shape[2] == 3 && d->itemsize == 1 && strcmp(d->format, "B") == 0 &&
                d->shape[0] > 0 && d->shape[1] > 0 && d->shape[0] <= 0xFFFF && d->shape[1] <= 0xFFFF &&
                (!max_pixels || (unsigned long long)d->shape[0] * (unsigned long long)d->shape[1] <= max_pixels) &&
                bufs[k].len >= 3 && memcmp(bufs[k].buf, "\xff\xd8\xff", 3) == 0;
    }
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < n; k++) {
        int r;
        if (!ok[k])
            continue;
        r = decode((const unsigned char *)bufs[k].buf, (size_t)bufs[k].len, 1, 0, 0, (JDIMENSION)dsts[k].shape[0],
                   (JDIMENSION)dsts[k].shape[1], (unsigned char *)dsts[k].buf, strict, max_pixels, 1, message);
        ok[k] = r > 0 ? 1 : r == 0 ? 0 : 2;
    }
    Py_END_ALLOW_THREADS
    status = PyBytes_FromStringAndSize((const char *)ok, n);
done:
    for (k = 0; k < got_bufs; k++)
        PyBuffer_Release(&bufs[k]);
    for (k = 0; k < got_dsts; k++)
        PyBuffer_Release(&dsts[k]);
    PyMem_Free(bufs);
    PyMem_Free(dsts);
    PyMem_Free(ok);
    Py_XDECREF(datas);
    Py_XDECREF(outs);
    return status;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, denom, top, left, out, strict, max_pixels, whole=False) -> bool: decode a JPEG region "
     "into out."},
    {"decode_many", decode_many, METH_VARARGS,
     "decode_many(datas, outs, strict, max_pixels) -> bytes: whole JPEGs into outs, per item 1 done, 0 not, 2 error."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_jpegregion", "JPEG region decode (libjpeg).", -1,
                                    methods, NULL, NULL, NULL, NULL};

PyMODINIT_FUNC PyInit__jpegregion(void) {
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "LIBJPEG_VERSION", JPEG_LIB_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
