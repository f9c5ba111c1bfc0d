"""Confidant runtime: data, model and training code for fine-tuning BERT-class models on edge devices."""
