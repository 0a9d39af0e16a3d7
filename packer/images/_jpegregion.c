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
 * A JPEG with a restart marker after every MCU (restart_transcode's output) decodes from a smaller JPEG of the
 * region's MCUs instead (build_sub): the entropy-coded data above and beside the region is never read.
 * libjpeg's error_exit longjmps back here, never exits the process. The GIL is released while libjpeg runs.
 *
 * restart_transcode(data, max_pixels) -> bytes | None: the JPEG rewritten losslessly with a restart marker per MCU.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <setjmp.h>
#include <stdio.h>
#include <string.h>

#include <jpeglib.h>
#include <jerror.h>

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


/* Restart-marked JPEGs (a restart marker after every MCU, as packer's --jpeg-restarts writes them): every MCU's
 * entropy-coded bytes decode on their own (a restart resets the DC predictors), so a region is decoded from a
 * smaller JPEG made of the header (its frame size patched) and the region's MCUs only, renumbered: neither the
 * rows above it nor the columns beside it are entropy-decoded. The region is widened by a guard of upsampling
 * reach and rounded out to MCUs, so its pixels are those of a whole decode (libjpeg's fancy upsampling only
 * reads neighbours within the guard). */

/* Offsets of the frame header and of the scan; 0 when the header is not a plain one (then no fast path). */
static int find_header(const unsigned char *data, size_t size, size_t *sof, size_t *scan) {
    size_t i = 2;
    *sof = 0;
    while (i + 4 <= size) {
        unsigned int marker, length;
        if (data[i] != 0xFF) return 0;
        marker = data[i + 1];
        if (marker == 0xFF) { i++; continue; } /* fill byte */
        if (marker == 0x01 || (marker >= 0xD0 && marker <= 0xD7)) { i += 2; continue; } /* TEM, RSTn: no length */
        length = ((unsigned int)data[i + 2] << 8) | data[i + 3];
        if (length < 2) return 0;
        if (marker == 0xC0 || marker == 0xC1) *sof = i;
        if (marker == 0xDA) {
            *scan = i + 2 + length;
            return *sof != 0 && *scan <= size;
        }
        i += 2 + length;
    }
    return 0;
}

/* Where each of the first `need` MCUs' bytes end (ends[k]: the offset of the marker after MCU k; MCU k > 0 starts
 * at ends[k - 1] + 2). 0 when the data is not one restart interval per MCU, numbered in order, with no fill bytes,
 * the last (MCU total - 1) followed by the end of image: then no fast path. */
static int find_ends(const unsigned char *data, size_t size, size_t scan, size_t need, size_t total, size_t *ends) {
    const unsigned char *p = data + scan, *end = data + size;
    size_t k = 0;
    while (k < need) {
        const unsigned char *ff = memchr(p, 0xFF, (size_t)(end - p));
        unsigned int m;
        if (ff == NULL || ff + 1 >= end) return 0;
        m = ff[1];
        if (m == 0x00) { p = ff + 2; continue; } /* a stuffed 0xFF data byte */
        if (m != (k + 1 == total ? 0xD9 : 0xD0 + (unsigned int)(k & 7))) return 0;
        ends[k++] = (size_t)(ff - data);
        p = ff + 2;
    }
    return 1;
}

/* Read a JPEG's header and set the output up: RGB at 1/denom. */
static void setup(j_decompress_ptr cinfo, const unsigned char *data, size_t size, int denom) {
    jpeg_mem_src(cinfo, data, (unsigned long)size);
    jpeg_read_header(cinfo, TRUE);
    cinfo->out_color_space = JCS_RGB;
    cinfo->scale_num = 1;
    cinfo->scale_denom = (unsigned int)denom;
    jpeg_calc_output_dimensions(cinfo);
}

/* A JPEG of the MCUs covering rows top..top+height and columns left..left+width of the image at 1/denom, plus a
 * guard (*sub, *sub_size: malloc'd; *sub_top, *sub_left: its corner on the 1/denom grid; *sub_height, *sub_width:
 * its size in full-resolution pixels, as its frame header says). 0 when the image is not
 * restart-marked per MCU (or the region needs the whole image): decode the original then. -1: out of memory. */
static int build_sub(const unsigned char *data, size_t size, j_decompress_ptr cinfo, int denom, JDIMENSION top,
                     JDIMENSION left, JDIMENSION height, JDIMENSION width, unsigned char **sub, size_t *sub_size,
                     JDIMENSION *sub_top, JDIMENSION *sub_left, JDIMENSION *sub_height, JDIMENSION *sub_width) {
    size_t sof, scan, cols, rows, r0, r1, c0, c1, need, total, r, c, k, n = 0, *ends;
    size_t H = cinfo->image_height, W = cinfo->image_width, mcu_w = 8, mcu_h = 8, gx, gy, y0, y1, x0, x1;
    unsigned char *p;
    if (cinfo->restart_interval != 1 || cinfo->progressive_mode || cinfo->arith_code ||
        cinfo->comps_in_scan != cinfo->num_components || (cinfo->num_components != 1 && cinfo->num_components != 3))
        return 0;
    if (cinfo->num_components == 3) { /* an interleaved scan: an MCU spans the largest sampling factors' blocks */
        mcu_w = 8 * (size_t)cinfo->max_h_samp_factor;
        mcu_h = 8 * (size_t)cinfo->max_v_samp_factor;
    }
    cols = (W + mcu_w - 1) / mcu_w;
    rows = (H + mcu_h - 1) / mcu_h;
    total = cols * rows;
    /* the guard: two chroma samples at the output scale, past anything fancy upsampling reads */
    gx = 2 * (size_t)denom * (mcu_w / 8);
    gy = 2 * (size_t)denom * (mcu_h / 8);
    y0 = (size_t)top * denom;
    x0 = (size_t)left * denom;
    y1 = ((size_t)top + height) * denom + gy;
    x1 = ((size_t)left + width) * denom + gx;
    r0 = (y0 > gy ? y0 - gy : 0) / mcu_h;
    c0 = (x0 > gx ? x0 - gx : 0) / mcu_w;
    r1 = ((y1 < H ? y1 : H) + mcu_h - 1) / mcu_h;
    c1 = ((x1 < W ? x1 : W) + mcu_w - 1) / mcu_w;
    if (r0 == 0 && c0 == 0 && r1 == rows && c1 == cols)
        return 0;
    if (!find_header(data, size, &sof, &scan))
        return 0;
    need = (r1 - 1) * cols + c1;
    if (need > (size - scan) / 3 + 1) /* each MCU takes a byte and a 2-byte marker: the header claims more than the
                                         data holds, so allocate nothing for it (the original's decode says why) */
        return 0;
    ends = malloc(need * sizeof(size_t));
    if (ends == NULL)
        return -1;
    if (!find_ends(data, size, scan, need, total, ends)) {
        free(ends);
        return 0;
    }
    *sub_size = scan + (r1 - r0) * (c1 - c0) * 2;
    for (r = r0; r < r1; r++)
        *sub_size += ends[r * cols + c1 - 1] - (r * cols + c0 == 0 ? scan : ends[r * cols + c0 - 1] + 2);
    *sub = p = malloc(*sub_size);
    if (p == NULL) {
        free(ends);
        return -1;
    }
    memcpy(p, data, scan);
    {
        size_t sub_h = (r1 * mcu_h < H ? r1 * mcu_h : H) - r0 * mcu_h, sub_w = (c1 * mcu_w < W ? c1 * mcu_w : W) - c0 * mcu_w;
        *sub_height = (JDIMENSION)sub_h;
        *sub_width = (JDIMENSION)sub_w;
        p[sof + 5] = (unsigned char)(sub_h >> 8);
        p[sof + 6] = (unsigned char)sub_h;
        p[sof + 7] = (unsigned char)(sub_w >> 8);
        p[sof + 8] = (unsigned char)sub_w;
    }
    p += scan;
    for (r = r0; r < r1; r++)
        for (c = c0; c < c1; c++) {
            k = r * cols + c;
            {
                size_t start = k == 0 ? scan : ends[k - 1] + 2, len = ends[k] - start;
                memcpy(p, data + start, len);
                p += len;
                *p++ = 0xFF;
                *p++ = (unsigned char)(r + 1 == r1 && c + 1 == c1 ? 0xD9 : 0xD0 + (n & 7));
                n++;
            }
        }
    free(ends);
    *sub_top = (JDIMENSION)(r0 * mcu_h / (size_t)denom);
    *sub_left = (JDIMENSION)(c0 * mcu_w / (size_t)denom);
    return 1;
}

/* The decode itself, without the GIL. Returns 1 done, 0 unsupported colour space, (whole) not the image's
 * size or (image_height > 0) a header saying another size than image_height x image_width, -1 error (message
 * set). */
static int decode(const unsigned char *data, size_t size, int denom, JDIMENSION top, JDIMENSION left,
                  JDIMENSION height, JDIMENSION width, unsigned char *out, int strict, unsigned long long max_pixels,
                  int whole, JDIMENSION image_height, JDIMENSION image_width, char *message) {
    struct jpeg_decompress_struct cinfo;
    struct region_error err;
    unsigned char *volatile row = NULL, *volatile sub = NULL;
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
        free(sub);
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
    if (cinfo.jpeg_color_space == JCS_CMYK || cinfo.jpeg_color_space == JCS_YCCK ||
        (image_height && (cinfo.image_height != image_height || cinfo.image_width != image_width))) {
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
    if (!whole) { /* a restart-marked JPEG: decode a smaller one of the region's MCUs instead */
        unsigned char *made = NULL;
        size_t made_size = 0;
        JDIMENSION sub_top = 0, sub_left = 0, sub_height = 0, sub_width = 0;
        int got = build_sub(data, size, &cinfo, denom, top, left, height, width, &made, &made_size, &sub_top,
                            &sub_left, &sub_height, &sub_width);
        if (got < 0) {
            snprintf(message, JMSG_LENGTH_MAX, "out of memory");
            jpeg_destroy_decompress(&cinfo);
            return -1;
        }
        if (got > 0) {
            int components = cinfo.num_components;
            sub = made;
            jpeg_abort_decompress(&cinfo);
            setup(&cinfo, made, made_size, denom);
            if (cinfo.image_height != sub_height || cinfo.image_width != sub_width || cinfo.restart_interval != 1 ||
                cinfo.num_components != components || top < sub_top || left < sub_left ||
                top - sub_top + height > cinfo.output_height || left - sub_left + width > cinfo.output_width) {
                /* a header the frame-size patch missed (build_sub's parse is not libjpeg's): the original */
                jpeg_abort_decompress(&cinfo);
                setup(&cinfo, data, size, denom);
            } else {
                top -= sub_top;
                left -= sub_left;
            }
        }
    }
    jpeg_start_decompress(&cinfo);
    {
        /* one guard pixel each side, so the region's edge columns are upsampled with their real neighbours */
        JDIMENSION x0 = left > 0 ? left - 1 : 0;
        JDIMENSION x1 = left + width < cinfo.output_width ? left + width + 1 : cinfo.output_width;
        /* and at least an iMCU wide: cropped to 2 chroma samples or fewer, libjpeg upsamples them without its
           fancy filter, unlike a whole decode */
        JDIMENSION min_w = (JDIMENSION)cinfo.max_h_samp_factor * (JDIMENSION)(8 / denom), xoffset, xwidth, y;
        if (x1 - x0 < min_w) {
            x1 = x0 + min_w < cinfo.output_width ? x0 + min_w : cinfo.output_width;
            x0 = x1 > min_w ? x1 - min_w : 0;
        }
        xoffset = x0;
        xwidth = x1 - x0;
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
    free(sub);
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
                    (JDIMENSION)width, (unsigned char *)out.buf, strict, max_pixels, whole, 0, 0, message);
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

/* decode_many(datas, outs, strict, max_pixels, regions=None) -> bytes: JPEGs, datas[k] into outs[k] (writable
 * C-contiguous uint8 buffers of shape (h, w, 3)), all in one call without the GIL. Without regions: whole images
 * at full size. With regions (C-contiguous int64, shape (n, 5): denom, top, left, image height, image width per
 * item): item k's region (as decode_region's) of a JPEG whose header must say that image size. Per item one byte:
 * 1 done, 0 not done (not a JPEG, CMYK/YCCK, out not such a buffer or above max_pixels, without regions out not
 * the header's size, with regions a header unlike the item's image size or values no JPEG has), 2 an error
 * (corrupt data, a header above max_pixels, a region outside the image). The caller decodes items not done one
 * by one, a path that says what is wrong; out may then hold some rows already. */
static PyObject *decode_many(PyObject *self, PyObject *args) {
    PyObject *datas_obj, *outs_obj, *regions_obj = Py_None, *datas = NULL, *outs = NULL, *status = NULL;
    Py_buffer *bufs = NULL, *dsts = NULL, regions;
    const long long *region = NULL;
    unsigned char *ok = NULL;
    int strict;
    unsigned long long max_pixels;
    Py_ssize_t n = 0, k, got_bufs = 0, got_dsts = 0;
    char message[JMSG_LENGTH_MAX];
    (void)self;

    memset(&regions, 0, sizeof(regions));
    if (!PyArg_ParseTuple(args, "OOpK|O", &datas_obj, &outs_obj, &strict, &max_pixels, &regions_obj))
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
    if (regions_obj != Py_None) {
        if (PyObject_GetBuffer(regions_obj, &regions, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) < 0)
            goto done;
        region = (const long long *)regions.buf;
        if (regions.ndim != 2 || regions.shape[0] != n || regions.shape[1] != 5 || regions.itemsize != 8 ||
            (strcmp(regions.format, "q") != 0 && strcmp(regions.format, "l") != 0)) {
            PyErr_SetString(PyExc_ValueError, "regions: expected a C-contiguous int64 array of shape (n, 5)");
            goto done;
        }
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
        if (region != NULL) { /* a known scale; a corner and image size JPEG can have, within max_pixels */
            const long long *r = region + 5 * k;
            ok[k] = ok[k] && (r[0] == 1 || r[0] == 2 || r[0] == 4 || r[0] == 8) && r[1] >= 0 && r[1] <= 0xFFFF &&
                    r[2] >= 0 && r[2] <= 0xFFFF && r[3] > 0 && r[3] <= 0xFFFF && r[4] > 0 && r[4] <= 0xFFFF &&
                    (!max_pixels || (unsigned long long)r[3] * (unsigned long long)r[4] <= max_pixels);
        }
    }
    Py_BEGIN_ALLOW_THREADS
    for (k = 0; k < n; k++) {
        int r;
        const long long *at = region == NULL ? NULL : region + 5 * k;
        if (!ok[k])
            continue;
        r = decode((const unsigned char *)bufs[k].buf, (size_t)bufs[k].len, at ? (int)at[0] : 1,
                   at ? (JDIMENSION)at[1] : 0, at ? (JDIMENSION)at[2] : 0, (JDIMENSION)dsts[k].shape[0],
                   (JDIMENSION)dsts[k].shape[1], (unsigned char *)dsts[k].buf, strict, max_pixels, at == NULL,
                   at ? (JDIMENSION)at[3] : 0, at ? (JDIMENSION)at[4] : 0, message);
        ok[k] = r > 0 ? 1 : r == 0 ? 0 : 2;
    }
    Py_END_ALLOW_THREADS
    status = PyBytes_FromStringAndSize((const char *)ok, n);
done:
    for (k = 0; k < got_bufs; k++)
        PyBuffer_Release(&bufs[k]);
    for (k = 0; k < got_dsts; k++)
        PyBuffer_Release(&dsts[k]);
    if (regions.obj != NULL)
        PyBuffer_Release(&regions);
    PyMem_Free(bufs);
    PyMem_Free(dsts);
    PyMem_Free(ok);
    Py_XDECREF(datas);
    Py_XDECREF(outs);
    return status;
}

/* A destination that grows its malloc'd buffer (jpeg_mem_dest's frees and replaces it as it grows, so an error
 * part-way could not tell which buffer to free). Lives in the caller of transcode (setjmp's frame). */
struct grow_dest {
    struct jpeg_destination_mgr pub;
    unsigned char *buf;
    size_t size;
};

static void grow_init(j_compress_ptr cinfo) {
    struct grow_dest *d = (struct grow_dest *)cinfo->dest;
    d->pub.next_output_byte = d->buf;
    d->pub.free_in_buffer = d->size;
}

static boolean grow_empty(j_compress_ptr cinfo) {
    struct grow_dest *d = (struct grow_dest *)cinfo->dest;
    size_t size = d->size * 2;
    unsigned char *buf = realloc(d->buf, size);
    if (buf == NULL) {
        cinfo->err->msg_code = JERR_OUT_OF_MEMORY;
        (*cinfo->err->error_exit)((j_common_ptr)cinfo);
    }
    d->pub.next_output_byte = buf + d->size;
    d->pub.free_in_buffer = size - d->size;
    d->buf = buf;
    d->size = size;
    return TRUE;
}

static void grow_term(j_compress_ptr cinfo) { (void)cinfo; }

/* The same JPEG with a restart marker after every MCU, losslessly (the DCT coefficients, quantization tables and
 * sampling copied, Huffman tables optimized, APPn/COM markers kept): its pixels are the source's, and a region
 * decodes from the region's MCUs only (build_sub). 1 done (*out malloc'd by libjpeg), 0 not done: not an 8-bit
 * YCbCr or grayscale JPEG, corrupt or truncated data (any libjpeg warning), above max_pixels. */
static int transcode(const unsigned char *data, size_t size, unsigned long long max_pixels, struct grow_dest *dest) {
    struct jpeg_decompress_struct src;
    struct jpeg_compress_struct dst;
    struct region_error err;
    jvirt_barray_ptr *coefs;
    jpeg_saved_marker_ptr m;
    volatile int made_dst = 0;
    int k;

    memset(&src, 0, sizeof(src));
    memset(&dst, 0, sizeof(dst));
    src.err = jpeg_std_error(&err.pub);
    err.pub.error_exit = on_error;
    err.pub.emit_message = on_message;
    err.pub.output_message = on_output;
    err.strict = 1; /* a warning (corrupt data that libjpeg would paper over) stops it: the source is kept */
    if (setjmp(err.jump)) {
        if (made_dst)
            jpeg_destroy_compress(&dst);
        jpeg_destroy_decompress(&src);
        return 0; /* the caller frees dest->buf */
    }
    jpeg_create_decompress(&src);
    jpeg_mem_src(&src, data, (unsigned long)size);
    jpeg_save_markers(&src, JPEG_COM, 0xFFFF);
    for (k = 0; k < 16; k++)
        jpeg_save_markers(&src, JPEG_APP0 + k, 0xFFFF);
    jpeg_read_header(&src, TRUE);
    if ((max_pixels && (unsigned long long)src.image_width * src.image_height > max_pixels) ||
        src.data_precision != 8 || (src.jpeg_color_space != JCS_YCbCr && src.jpeg_color_space != JCS_GRAYSCALE)) {
        jpeg_destroy_decompress(&src);
        return 0;
    }
    coefs = jpeg_read_coefficients(&src);
    if (src.progressive_mode) { /* scans left unrefined: libjpeg smooths such blocks, a baseline file would not */
        int c;
        for (c = 0; c < src.num_components; c++)
            for (k = 0; k < DCTSIZE2; k++)
                if (src.coef_bits[c][k] != 0) {
                    jpeg_destroy_decompress(&src);
                    return 0;
                }
    }
    dst.err = &err.pub;
    jpeg_create_compress(&dst);
    made_dst = 1;
    jpeg_copy_critical_parameters(&src, &dst);
    dst.restart_interval = 1;
    dst.optimize_coding = TRUE;
    dest->pub.init_destination = grow_init;
    dest->pub.empty_output_buffer = grow_empty;
    dest->pub.term_destination = grow_term;
    dst.dest = &dest->pub;
    jpeg_write_coefficients(&dst, coefs);
    for (m = src.marker_list; m != NULL; m = m->next) {
        /* libjpeg writes its own JFIF (APP0) and Adobe (APP14) markers where the colour space calls for them */
        if (dst.write_JFIF_header && m->marker == JPEG_APP0 && m->data_length >= 5 && memcmp(m->data, "JFIF", 5) == 0)
            continue;
        if (dst.write_Adobe_marker && m->marker == JPEG_APP0 + 14 && m->data_length >= 5 &&
            memcmp(m->data, "Adobe", 5) == 0)
            continue;
        jpeg_write_marker(&dst, m->marker, m->data, m->data_length);
    }
    jpeg_finish_compress(&dst);
    jpeg_finish_decompress(&src);
    jpeg_destroy_compress(&dst);
    jpeg_destroy_decompress(&src);
    return 1;
}

static PyObject *restart_transcode(PyObject *self, PyObject *args) {
    Py_buffer data;
    unsigned long long max_pixels;
    struct grow_dest dest;
    int done;
    PyObject *result;
    (void)self;

    if (!PyArg_ParseTuple(args, "y*K", &data, &max_pixels))
        return NULL;
    memset(&dest, 0, sizeof(dest));
    dest.size = (size_t)data.len + 4096; /* about the source's size: rarely grown */
    dest.buf = malloc(dest.size);
    if (dest.buf == NULL) {
        PyBuffer_Release(&data);
        return PyErr_NoMemory();
    }
    Py_BEGIN_ALLOW_THREADS
    done = transcode((const unsigned char *)data.buf, (size_t)data.len, max_pixels, &dest);
    Py_END_ALLOW_THREADS
    PyBuffer_Release(&data);
    result = done ? PyBytes_FromStringAndSize((const char *)dest.buf, (Py_ssize_t)(dest.size - dest.pub.free_in_buffer))
                  : Py_NewRef(Py_None);
    free(dest.buf);
    return result;
}

static PyMethodDef methods[] = {
    {"decode_region", decode_region, METH_VARARGS,
     "decode_region(data, denom, top, left, out, strict, max_pixels, whole=False) -> bool: decode a JPEG region "
     "into out."},
    {"decode_many", decode_many, METH_VARARGS,
     "decode_many(datas, outs, strict, max_pixels, regions=None) -> bytes: JPEGs (whole, or regions) into outs, "
     "per item 1 done, 0 not, 2 error."},
    {"restart_transcode", restart_transcode, METH_VARARGS,
     "restart_transcode(data, max_pixels) -> bytes | None: the JPEG losslessly with a restart marker per MCU."},
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
