"""Quantized weights held on the devices: block formats, their numpy codecs and the dequantizing weight."""
